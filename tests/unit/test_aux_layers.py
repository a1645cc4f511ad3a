"""Aux layer ids from a draft config -> capture indices on the target, with the convention made explicit."""

from __future__ import annotations

import logging

import pytest

from tandem.models.aux_layers import AuxLayerError, CaptureSpec, resolve_capture

LOGGER = "tandem.models.aux_layers"


def test_auto_reads_first_id_one_as_layer_outputs() -> None:
    spec = resolve_capture([1, 15, 28], num_layers=32, num_aux=3)
    assert spec == CaptureSpec(indices=(2, 16, 29), convention="output", layer_ids=(1, 15, 28))


def test_auto_reads_first_id_two_as_layer_inputs() -> None:
    spec = resolve_capture([2, 16, 29], num_layers=32, num_aux=3)
    assert spec == CaptureSpec(indices=(2, 16, 29), convention="input", layer_ids=(2, 16, 29))


def test_explicit_output_overrides_auto() -> None:
    spec = resolve_capture([2, 16, 29], num_layers=32, num_aux=3, convention="output")
    assert (spec.indices, spec.convention) == ((3, 17, 30), "output")


def test_explicit_input_overrides_auto() -> None:
    spec = resolve_capture([1, 15, 28], num_layers=32, num_aux=3, convention="input")
    assert (spec.indices, spec.convention) == ((1, 15, 28), "input")


def test_order_of_ids_is_kept() -> None:
    # The draft's fc concatenates the aux states in the order the config lists them.
    assert resolve_capture([10, 2, 5], num_layers=16, num_aux=3).indices == (10, 2, 5)


def test_resolved_indices_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        resolve_capture([1, 15, 28], num_layers=32, num_aux=3)
    records = [record for record in caplog.records if record.name == LOGGER]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "[2, 16, 29]" in message
    assert "output" in message


@pytest.mark.parametrize("empty", [None, []])
def test_missing_ids_fall_back_to_defaults_with_a_loud_warning(
    caplog: pytest.LogCaptureFixture, empty: list[int] | None
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        spec = resolve_capture(empty, num_layers=32, num_aux=3)
    assert spec == CaptureSpec(indices=(2, 16, 29), convention="default", layer_ids=None)
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "DEFAULT" in warnings[0].getMessage()
    assert "[2, 16, 29]" in warnings[0].getMessage()


def test_defaults_refused_when_the_draft_expects_another_count() -> None:
    with pytest.raises(AuxLayerError, match="default set has 3 layers while the draft expects 2"):
        resolve_capture(None, num_layers=32, num_aux=2)


@pytest.mark.parametrize(
    ("layer_ids", "convention", "bad_index"),
    [
        ([1, 4, 9], "auto", 10),  # output convention: 9 + 1 = 10 > 8
        ([2, 4, 9], "input", 9),
        ([3, 5, 8], "output", 9),
        ([-1, 2, 3], "input", -1),
    ],
)
def test_out_of_range_ids_refused(layer_ids: list[int], convention: str, bad_index: int) -> None:
    with pytest.raises(AuxLayerError) as error:
        resolve_capture(layer_ids, num_layers=8, num_aux=3, convention=convention)  # type: ignore[arg-type]
    message = str(error.value)
    assert f"aux capture index {bad_index} " in message
    assert "0..8" in message


def test_capture_index_num_layers_is_allowed() -> None:
    # Index L is the final stream before the final norm.
    assert resolve_capture([2, 4, 8], num_layers=8, num_aux=3).indices == (2, 4, 8)


def test_defaults_out_of_range_for_a_tiny_target() -> None:
    with pytest.raises(AuxLayerError, match=r"aux capture index -1 is outside the target's range 0\.\.2"):
        resolve_capture(None, num_layers=2, num_aux=3)


def test_count_mismatch_refused() -> None:
    with pytest.raises(AuxLayerError, match=r"2 ids \[1, 5\], but the draft's fc expects 3"):
        resolve_capture([1, 5], num_layers=16, num_aux=3)


def test_unknown_convention_refused() -> None:
    with pytest.raises(AuxLayerError, match="'outputs' is not one of auto, output, input"):
        resolve_capture([1, 5, 9], num_layers=16, num_aux=3, convention="outputs")  # type: ignore[arg-type]


def test_default_set_comes_from_the_target_family(caplog: pytest.LogCaptureFixture) -> None:
    from tandem.models.registry import target_architecture

    gemma_default = target_architecture("Gemma3ForCausalLM").default_capture_indices
    with caplog.at_level(logging.WARNING):
        spec = resolve_capture(None, num_layers=26, num_aux=3, default_indices=gemma_default)
    assert spec.indices == (2, 13, 24)
    assert "[2, 13, 24]" in caplog.text and "DEFAULT" in caplog.text
