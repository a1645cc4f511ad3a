"""Chat messages to prompt token ids, through a Jinja chat template: the tokenizer's own, or --chat-template FILE.

A rendered template holds its special tokens (BOS, turn markers) as text, so it is tokenized without adding any
(as Hugging Face transformers does in apply_chat_template). A request's tools go to the template as `tools` (the
OpenAI objects), and earlier tool calls as each assistant message's `tool_calls`, their arguments an object, as
transformers documents, or the JSON text for templates that concatenate it (DeepSeek-V3's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from orchestrator.api.openai_protocol import ApiError, bad_field
from orchestrator.loop.prompt_images import ImageLayout
from tandem.errors import StartupError
from tandem.models.image_prompt import CROPS_BEFORE, CROPS_BETWEEN


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, path: Path | None) -> str | None:
    """The template to render chats with: the file when one is given, else the tokenizer's (None: it has none)."""
    if path is None:
        template = tokenizer.chat_template
        return template if isinstance(template, str) else None
    try:
        return path.read_text()
    except OSError as error:
        raise StartupError(f"--chat-template {path}: cannot be read ({error.strerror})") from error


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    max_characters: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
    arguments_as_text: bool = False,
    images: tuple[ImageLayout, Sequence[tuple[int, int]]] | None = None,
) -> list[int]:
    """Renders the messages with a generation prompt for the assistant and tokenizes them.

    A chat longer than max_characters is refused before rendering (as check_bounds refuses a long prompt unread).
    `images`: the target's image layout and the (height, width) of each image the messages hold, in order, each
    written where the template marks it (expand_images).
    """
    if template is None:
        raise bad_field(
            "messages",
            "the served model's tokenizer has no chat template; start the orchestrator with --chat-template FILE "
            "(a Jinja template), or use /v1/completions",
        )
    characters = sum(
        _characters(message["content"]) + len(json.dumps(message.get("tool_calls", ""))) for message in messages
    )
    characters += len(json.dumps(tools)) if tools else 0
    if characters > max_characters:
        raise bad_field("messages", f"{characters} characters cannot fit the context (refused above {max_characters})")
    conversation = [_for_template(message, arguments_as_text) for message in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=[dict(tool) for tool in tools] if tools else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as error:  # a template may raise anything (raise_exception(), undefined names, ...)
        raise ApiError(400, f"messages: the chat template cannot render them: {error}", "messages") from error
    assert isinstance(text, str)
    if images is not None:
        text = expand_images(text, tokenizer, *images)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_field("messages", "the chat template renders them to no tokens")
    return list(ids)


def expand_images(
    text: str, tokenizer: PreTrainedTokenizerBase, layout: ImageLayout, sizes: Sequence[tuple[int, int]]
) -> str:
    """The rendered chat with each image's mark (what the template writes for an image part) replaced by the image's
    tokens as the checkpoint's processor writes them (tandem.models.image_prompt): `around`, begin, as many
    placeholders as an image of that (height, width) takes, end, `around`; with pan-and-scan crops, the image's and
    then each crop's, in the processor's words."""
    prompt = layout.prompt
    mark = str(tokenizer.convert_ids_to_tokens(prompt.mark_token_id))
    pieces = text.split(mark)
    if len(pieces) - 1 != len(sizes):
        raise bad_field(
            "messages", f"the chat template marks {len(pieces) - 1} images ({mark!r}) for the {len(sizes)} sent"
        )
    written = [pieces[0]]
    for index, ((height, width), after) in enumerate(zip(sizes, pieces[1:], strict=True)):
        try:
            placeholders, crops = prompt.tokens(height, width), prompt.crops(height, width)
        except ValueError as error:
            raise bad_field("messages", f"image {index + 1} of {len(sizes)}: {error}") from None
        tokens = "".join(str(token) for token in tokenizer.convert_ids_to_tokens(prompt.expansion(placeholders)))
        image = f"{prompt.around}{tokens}{prompt.around}"
        if crops:
            image = CROPS_BEFORE + image + CROPS_BETWEEN + " ".join([image] * crops)
        written += [image, after]
    return "".join(written)


def _characters(content: str | Sequence[Mapping[str, str]]) -> int:
    """A message content's characters: its text's, or its text parts' (an image part counts none)."""
    return len(content) if isinstance(content, str) else sum(len(part.get("text", "")) for part in content)


def _for_template(message: Mapping[str, Any], arguments_as_text: bool) -> dict[str, Any]:
    """The message as templates take it: tool call arguments as an object unless the template wants the text."""
    calls = message.get("tool_calls")
    if calls is None or arguments_as_text:
        return dict(message)
    objects = [
        {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
        for call in calls
    ]
    return {**message, "tool_calls": objects}
