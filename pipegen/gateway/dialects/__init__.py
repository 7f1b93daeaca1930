"""The three dialects a harness may speak, to and from one internal shape, one module each on one shared
shapes module (as SGLang's entrypoints/openai/serving_*.py are):

- `openai_chat.py`: OpenAI chat completions (`/v1/chat/completions`), chunks and `[DONE]`;
- `openai_responses.py`: OpenAI responses (`/v1/responses`), typed events;
- `anthropic_messages.py`: Anthropic messages (`/v1/messages`), typed events;
- `shapes.py`: what they share: `ChatRequest`, `Reply`, the chat-template form of a message (`canonical`).

Every request becomes a `ChatRequest` whose messages are in the chat-template form: the form the model's chat
template renders and the form two conversations are compared in. Every answer is a `Reply`, written back in the
dialect it was asked in. Streams are synthesized from the finished reply (the capture never depends on a stream
reaching the client).
Owns: which dialect a route speaks (`DIALECTS`). Must never: tokenize, generate, or accept a setting it cannot
honour (a request pipegen cannot serve as asked is refused with one line naming the setting: `BadRequest`).
"""

from __future__ import annotations

from pipegen.gateway.dialects import anthropic_messages, openai_chat, openai_responses
from pipegen.gateway.dialects.shapes import BadRequest, Dialect

# the dialects by route
DIALECTS: dict[str, Dialect] = {
    "chat": openai_chat.DIALECT,
    "responses": openai_responses.DIALECT,
    "messages": anthropic_messages.DIALECT,
}

__all__ = ["DIALECTS", "BadRequest", "Dialect"]
