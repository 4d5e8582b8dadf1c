"""Items that carry sealed content: compaction items, and reasoning items returned with
`include: ["reasoning.encrypted_content"]`.

On the way in (`open_sealed`), each blob is opened for the request's tenant before anything is
resolved or rendered: a compaction item gets its summary in `SUMMARY` (what the renderer shows the
model; never listed back to a client), a reasoning item gets its text back as `content`, where the
template decides whether to render it. A blob that does not open is a 400 naming the item.
On the way out, `compaction_item` and `seal_reasoning` make the blobs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cluster.core.render.renderer import COMPACTION_SUMMARY as SUMMARY
from cluster.protocol.ids import new_id
from cluster.protocol.sealing import Sealer, unopenable

INCLUDE_REASONING = "reasoning.encrypted_content"


def open_sealed(items: Sequence[dict[str, Any]], sealer: Optional[Sealer], tenant: Optional[str],
                *, first_index: int = 0) -> list[dict[str, Any]]:
    """`items` with their sealed content opened (copies of the items that change).

    Without a sealer (a server configured to seal nothing) a compaction item cannot be read and
    is refused the same way; a reasoning item's blob is then left unread (its summary stands)."""
    out = list(items)
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input[{i + first_index}].encrypted_content"
        if kind == "compaction":
            if sealer is None:
                raise unopenable(param, item.get("id"))
            payload = sealer.open("compaction", item.get("encrypted_content"), tenant, param=param,
                                  item_id=item.get("id"))
            out[i] = {**item, SUMMARY: str(payload.get("summary", ""))}
        elif kind == "reasoning" and item.get("encrypted_content") and sealer is not None:
            payload = sealer.open("reasoning", item["encrypted_content"], tenant, param=param, item_id=item.get("id"))
            out[i] = {**item, "content": [{"type": "reasoning_text", "text": str(payload.get("text", ""))}]}
    return out


def compaction_item(summary: str, sealer: Sealer, tenant: Optional[str]) -> dict[str, Any]:
    """The one `compaction` item standing for what a compaction dropped."""
    return {"id": new_id("cmp"), "type": "compaction",
            "encrypted_content": sealer.seal("compaction", {"summary": summary}, tenant)}


def seal_reasoning(text: str, sealer: Sealer, tenant: Optional[str]) -> str:
    return sealer.seal("reasoning", {"text": text}, tenant)


def without_private(item: dict[str, Any]) -> dict[str, Any]:
    """An item as a client may see it: no server-side keys."""
    return {k: v for k, v in item.items() if not k.startswith("_")} if SUMMARY in item else item
