"""gpt-oss's output, parsed from its tokens with openai-harmony's streaming parser.

Harmony output is read from token ids, not text: `<|channel|>`, `<|message|>`, `<|call|>` are
special tokens a text decode drops. Each message the model writes is one of
- `analysis`: reasoning, streamed as it comes (a reasoning item);
- `commentary` to `functions.<name>`: a tool call, released when its message ends (`<|call|>`);
- `final` (or `commentary` with no recipient, a preamble): the answer's text, streamed as it comes.
A token the grammar does not allow (a model that loses the format, the tiny random model) ends
the parse: that token and everything after it are text, so nothing generated is lost.
"""

from __future__ import annotations

from typing import Sequence

from cluster.core.messages import Piece, ReasoningPiece, TextPiece, ToolCallPiece, merged

FUNCTIONS = "functions."


class HarmonyOutputParser:
    """Feed engine deltas (their token ids), get pieces; `finish()` flushes what is held back."""

    def __init__(self, encoding, *, tools_enabled: bool = True) -> None:
        from openai_harmony import Role, StreamableParser

        self._enc = encoding
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self._tools_enabled = tools_enabled
        self._seen = 0  # messages of the parser's already turned into pieces
        self._broken = False  # the format was lost: the rest is text
        self._header: list[int] = []  # tokens of a message header not yet closed by `<|message|>`
        self.tool_calls = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Piece]:
        out: list[Piece] = []
        for i, token in enumerate(token_ids):
            if self._broken:
                out.append(TextPiece(self._enc.decode(list(token_ids[i:]))))
                break
            try:
                self._parser.process(token)
            except Exception:  # noqa: BLE001 - openai_harmony raises HarmonyError for a token out of grammar
                self._broken = True
                out.append(TextPiece(self._enc.decode(list(token_ids[i:]))))
                break
            out += self._ended()
            if self._parser.state.name == "HEADER":
                self._header.append(token)
            else:
                self._header.clear()
            delta = self._parser.last_content_delta
            if delta and not self._is_call(self._parser.current_recipient):
                out.append(ReasoningPiece(delta) if self._parser.current_channel == "analysis" else TextPiece(delta))
        return merged([out])  # type: ignore[return-value]  # pieces in, pieces out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._header and not self._broken:  # a header never closed: what the model wrote is text
            out.append(TextPiece(self._enc.decode(self._header)))
        elif not self._broken:
            if self._parser.state.name == "CONTENT" and self._is_call(self._parser.current_recipient):
                # A call cut off before its `<|call|>` (max tokens): its arguments are not whole; text.
                out.append(TextPiece(self._parser.current_content))
            else:
                try:
                    self._parser.process_eos()
                    out += self._ended()
                except Exception:  # noqa: BLE001 - nothing left that makes a message
                    pass
        return merged([out])  # type: ignore[return-value]

    def _is_call(self, recipient) -> bool:
        return self._tools_enabled and bool(recipient) and recipient.startswith(FUNCTIONS)

    def _ended(self) -> list[Piece]:
        """The tool calls among the messages that ended since the last look."""
        out: list[Piece] = []
        messages = self._parser.messages
        for message in messages[self._seen:]:
            if self._is_call(message.recipient):
                arguments = "".join(getattr(part, "text", "") for part in message.content)
                out.append(ToolCallPiece(message.recipient[len(FUNCTIONS):], arguments))
                self.tool_calls += 1
        self._seen = len(messages)
        return out
