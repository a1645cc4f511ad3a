"""A draft's input embedding at an image's tokens (draft_server.image_inputs): the placeholder token's, or the
target's merged one (the image's features), which the target sends with the rows before them
(target_server.images.add_image_embeddings) to a replica that subscribed for it. Checked on a Gemma 3 image prompt
through the target's own rows, messages in chunks, and an EAGLE3 head as wide as the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_server.compat import IncompatibleDraft
from draft_server.formats import prepare_draft
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from draft_server.settings import DraftSettings
from tandem.layers.kv_cache import SequenceKV
from tandem.models.config import ConfigError
from tandem.models.eagle3 import Eagle3Config
from tandem.models.registry import load_target
from tandem.parallel.vocab import assemble_shards
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from tandem.wire.codec import tensor_to_proto
from target_server.images import add_image_embeddings
from target_server.items import ImageInput, OpenRequest, RowStream, StepItem
from target_server.main import target_info
from target_server.runner import TargetRunner
from target_server.service import hidden_messages
from tests.helpers.checkpoints import TinyEagle3Spec, write_tiny_eagle3
from tests.helpers.gemma4_checkpoints import VOCAB, write_tiny_gemma3_multimodal

BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
CACHE = KVCacheSettings(num_blocks=64, block_size=4)
VISION = {"image_size": 28, "patch_size": 14, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 48}


def test_rows_before_an_images_tokens_carry_their_features() -> None:
    # The docstring's example: rows from position 10, 5 of them, an image at tokens 12..15.
    features = torch.arange(16.0).view(4, 4)
    message = target_pb2.HiddenStates(
        start_position=10, next_tokens=[1, 2, 3, 4, 5], features=tensor_to_proto(torch.zeros((5, 8)))
    )
    add_image_embeddings(message, [ImageInput(12, features, "d")])
    assert list(message.image_rows) == [1, 2, 3, 4]
    # Rows that end before the image, and rows past it, carry none.
    for start in (4, 15):
        clear = target_pb2.HiddenStates(start_position=start, next_tokens=[1, 2, 3])
        add_image_embeddings(clear, [ImageInput(12, features, "d")])
        assert not clear.image_rows and not clear.HasField("image_embeddings")
    rows = TargetRows.of(message)
    assert rows.image_embeddings is not None and torch.equal(rows.image_embeddings[1], features)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("image-drafts")
    target = write_tiny_gemma3_multimodal(root / "target", seed=6, vision=VISION)
    shape = root / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(json.loads((target / "config.json").read_text())["text_config"]))
    head = write_tiny_eagle3(root / "head", shape, TinyEagle3Spec(layer_ids=[0, 1, 2], seed=4))
    return target, head


def prepared_runner(target: TargetRunner, head: Path, image_embeddings: Any) -> tuple[DraftRunner, bool]:
    settings = DraftSettings(model_dir=head, target_address="unused", num_steps=2, image_embeddings=image_embeddings)
    prepared = prepare_draft(settings, target_info(target, "float32"))
    if prepared.missing_tables:  # a head without its own table takes the target's
        vocab = target.model.config.vocab_size
        prepared.fill_table("embed_tokens", assemble_shards(target.weight_shards("embed_tokens"), vocab))
    runner = prepared.build_runner(CACHE)
    assert isinstance(runner, DraftRunner)
    return runner, prepared.image_embeddings


def test_a_merged_draft_embeds_an_images_tokens_as_the_targets_input(pair: tuple[Path, Path]) -> None:
    target_dir, head = pair
    target = TargetRunner(load_target(target_dir), CACHE, max_context=128)
    prompt = [2, 40, 41, BOI, *[IMAGE] * 4, EOI, 50, 51]
    image = ImageInput(4, torch.randn((4, 64), generator=torch.Generator().manual_seed(3)), "digest")
    stream = RowStream(capture=(1, 2, 3), image_embeddings=True)
    request = OpenRequest(prompt, SamplingParams(), images=(image,))
    (result,) = target.step([StepItem("r", len(prompt), open=request, stream=stream)])
    assert result.captured is not None
    # The rows in messages of 4 rows at most, each with its own image rows, joined again by the replica.
    messages = hidden_messages(result.captured, 0, chunk_bytes=4 * result.captured.features[0].nbytes)
    for message in messages:
        add_image_embeddings(message, [image])
    assert [list(message.image_rows) for message in messages] == [[3], [0, 1, 2], []]
    rows = TargetRows.of(messages[0]).followed_by(TargetRows.of(messages[1])).followed_by(TargetRows.of(messages[2]))
    drafts = {}
    for choice in ("merged", "placeholder"):
        runner, merged = prepared_runner(target, head, choice)
        assert merged == (choice == "merged")
        _, hidden, _ = runner.ingest([ProposeInput("r", rows if merged else without_images(rows), 2)])
        drafts[choice] = hidden
    # The same as the head run on the rows with the image's features given as the embeddings of rows 3..6, whose
    # next tokens are the image's placeholders.
    runner, _ = prepared_runner(target, head, "placeholder")
    expected = runner.model(
        torch.tensor(rows.next_tokens),
        runner.model.project_features(rows.features),
        runner.cache.plan([(SequenceKV(), len(rows.next_tokens))]),
        runner.cache,
        embeddings=(torch.arange(3, 7), image.features),
    ).hidden[-1:]
    assert torch.allclose(drafts["merged"], expected, atol=1e-6)
    assert (drafts["merged"] - drafts["placeholder"]).abs().max().item() > 1e-3


def without_images(rows: TargetRows) -> TargetRows:
    return TargetRows(rows.start_position, rows.next_tokens, rows.features, rows.prefix)


def test_merged_needs_a_head_as_wide_as_the_target(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, head = pair
    target = TargetRunner(load_target(target_dir), CACHE, max_context=128)
    narrow = write_tiny_eagle3(
        tmp_path / "narrow", head, TinyEagle3Spec(hidden_size=32, layer_ids=[0, 1, 2], include_embedding=True)
    )
    with pytest.raises(IncompatibleDraft, match="the draft's hidden_size 32 is not the target's 64"):
        prepared_runner(target, narrow, "merged")
    assert prepared_runner(target, narrow, "checkpoint")[1] is False  # no key: the placeholder's
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {"image_embeddings": "merged"}))
    assert prepared_runner(target, head, "checkpoint")[1] is True
    with pytest.raises(ConfigError, match="image_embeddings: 'both' is not 'placeholder' or 'merged'"):
        Eagle3Config.from_hf(config | {"image_embeddings": "both"})
