"""What a draft takes as the input embedding of an image's tokens: two conventions in the field.

At a row whose next token is an image's placeholder, an EAGLE3 or NextN head embeds that token. vLLM's EAGLE3 drafts
embed the placeholder token itself ("placeholder", the default); SGLang's take the target's merged input embedding
there, the image's feature ("merged"). With "merged" the replica subscribes with image_embeddings, and the target
sends the features with those rows (target_server.images.add_image_embeddings). Chosen per draft checkpoint: an
EAGLE3 config's `image_embeddings` key (this project's), else `--image-embeddings` ("checkpoint": the key, or
"placeholder" where there is none).
"""

from __future__ import annotations

from draft_server.compat import IncompatibleDraft
from draft_server.settings import ImageEmbeddings


def takes_merged(choice: ImageEmbeddings, checkpoint: str | None, draft_hidden: int, target_hidden: int) -> bool:
    """Whether the draft embeds an image's tokens as the target's merged input; refuses a draft whose width is not
    the target's, whose embeddings it would take."""
    chosen = (checkpoint or "placeholder") if choice == "checkpoint" else choice
    if chosen == "placeholder":
        return False
    if draft_hidden != target_hidden:
        raise IncompatibleDraft(
            f"image embeddings 'merged': the draft's hidden_size {draft_hidden} is not the target's {target_hidden}, "
            "whose image features it would take as embeddings"
        )
    return True
