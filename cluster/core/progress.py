"""What a response's event stream has said so far: the one reader of stream events by type.

The turn driver, compaction, the WebSocket session and the HTTP route need the same few facts
from a stream (its response id once created, each output item as it starts, the final response,
an error event), and act on them. They read them from a `TurnProgress` fed every event, not by
matching event type strings themselves. Type names come from the `openai` package's event types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, get_args

from openai.types.responses import ResponseCreatedEvent, ResponseErrorEvent, ResponseOutputItemAddedEvent

from cluster.core.events import TERMINAL_EVENTS, Event


def _type_of(event_class: Any) -> str:
    return get_args(event_class.model_fields["type"].annotation)[0]


CREATED, ITEM_ADDED, ERROR = (_type_of(t) for t in (ResponseCreatedEvent, ResponseOutputItemAddedEvent,
                                                    ResponseErrorEvent))


class Milestone(enum.Enum):
    """What one event means to the code that drives a response."""

    CREATED = "created"  # the response exists: `TurnProgress.response_id`
    ITEM_ADDED = "item_added"  # an output item started: `TurnProgress.last_item`
    TERMINAL = "terminal"  # the response ended: `TurnProgress.final`
    ERROR = "error"  # an error event (a failed response's terminal event follows): `TurnProgress.error`
    NONE = "none"  # anything else (deltas, done events, ...)


@dataclass(slots=True)
class TurnProgress:
    response_id: Optional[str] = None
    last_item: Optional[dict[str, Any]] = None
    final: Optional[dict[str, Any]] = None
    error: Optional[Event] = None

    def observe(self, ev: Event) -> Milestone:
        kind = ev["type"]
        if kind == CREATED:
            self.response_id = ev["response"]["id"]
            return Milestone.CREATED
        if kind == ITEM_ADDED:
            self.last_item = ev["item"]
            return Milestone.ITEM_ADDED
        if kind in TERMINAL_EVENTS:
            self.final = ev["response"]
            self.response_id = self.final["id"]
            return Milestone.TERMINAL
        if kind == ERROR:
            self.error = ev
            return Milestone.ERROR
        return Milestone.NONE

    @property
    def status(self) -> Optional[str]:
        """The final response's status (None until a terminal event)."""
        return self.final["status"] if self.final is not None else None
