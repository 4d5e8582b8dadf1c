"""The Conversations API's wire shapes: the bodies of `/v1/conversations` and its items, as
OpenAI defines them (`openai.types.conversations`), validated into plain values; every
failure is a 400 `ApiError`. The objects it answers with are built here too."""

from __future__ import annotations

from typing import Any, Optional

from cluster.protocol.errors import ApiError, invalid_request
from cluster.protocol.requests import parse_request

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's: "You may add up to 20 items at a time."
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
LIST_ORDERS = ("asc", "desc")


def metadata_of(body: dict[str, Any], *, required: bool = False) -> Optional[dict[str, str]]:
    """`metadata`: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    value = body.get("metadata")
    if value is None:
        if required:
            raise invalid_request("Missing required parameter: 'metadata'.", param="metadata",
                                  code="missing_required_parameter")
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid_request("Invalid 'metadata': expected an object of string keys and string values.",
                              param="metadata", code="invalid_type")
    if len(value) > MAX_METADATA_PAIRS:
        raise invalid_request(f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs.", param="metadata",
                              code="invalid_value")
    for key, val in value.items():
        if len(key) > MAX_METADATA_KEY or len(val) > MAX_METADATA_VALUE:
            raise invalid_request(f"Invalid 'metadata': keys are at most {MAX_METADATA_KEY} characters and "
                                  f"values at most {MAX_METADATA_VALUE}.", param="metadata", code="invalid_value")
    return dict(value)


def items_of(body: dict[str, Any], *, required: bool = False) -> list[dict[str, Any]]:
    """`items`: up to 20 input items, validated as a response's input is (the same types)."""
    items = body.get("items")
    if items is None:
        if required:
            raise invalid_request("Missing required parameter: 'items'.", param="items",
                                  code="missing_required_parameter")
        return []
    if not isinstance(items, list):
        raise invalid_request("Invalid 'items': expected an array of items.", param="items", code="invalid_type")
    if len(items) > MAX_ITEMS_PER_REQUEST:
        raise invalid_request(f"Invalid 'items': array too long. Expected an array with maximum length "
                              f"{MAX_ITEMS_PER_REQUEST}, but got an array with length {len(items)} instead.",
                              param="items", code="array_above_max_length")
    try:
        return parse_request({"input": items}, max_input_items=MAX_ITEMS_PER_REQUEST).input_items()
    except ApiError as err:  # the same checks as `input`, named for where they are here
        raise ApiError(400, err.message.replace("'input", "'items"), param=(err.param or "input").replace(
            "input", "items", 1), code=err.code) from None


def create_body(body: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """POST /v1/conversations: (items, metadata)."""
    body = _object(body)
    return items_of(body), metadata_of(body) or {}


def update_body(body: Any) -> dict[str, str]:
    """POST /v1/conversations/{id}: the new metadata (it replaces the old)."""
    return metadata_of(_object(body), required=True) or {}


def items_create_body(body: Any) -> list[dict[str, Any]]:
    """POST /v1/conversations/{id}/items."""
    return items_of(_object(body), required=True)


def page_query(limit: int, order: str) -> None:
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
    if order not in LIST_ORDERS:
        raise ApiError(400, "order must be 'asc' or 'desc'.", param="order", code="invalid_value")


def _object(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


# -- what the API answers -------------------------------------------------------------
def conversation_object(conversation_id: str, created_at: float, metadata: dict[str, str]) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation", "created_at": int(created_at), "metadata": metadata}


def deleted_object(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def item_list(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def conversation_not_found(conversation_id: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id[:256]}' not found.", code="not_found",
                    param="conversation_id")


def item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id[:256]}' not found.", code="not_found", param="item_id")
