"""Mismatches and broken checkpoints are refused at start-up with a message that names the values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.dflash_checkpoints import TinyDFlashSpec, write_tiny_dflash
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from tests.integration.stack import run_to_exit


def serve_to_exit(target: Path, draft: Path | None = None, *extra: str) -> str:
    arguments = ["serve", "--target", str(target), "--port", "0", *extra]
    if draft is not None:
        arguments += ["--draft", str(draft)]
    result = run_to_exit(arguments)
    assert result.returncode != 0, result.stdout
    assert "tandem ready" not in result.stdout
    return result.stdout


def test_draft_for_another_hidden_size_is_refused(tmp_path: Path, llama_target: Path) -> None:
    wider = write_tiny_target(tmp_path / "wider", TinyTargetSpec(hidden_size=96, num_layers=6))
    draft = write_tiny_eagle3(tmp_path / "draft", wider, TinyEagle3Spec(layer_ids=(1, 2, 3), include_embedding=True))
    output = serve_to_exit(llama_target, draft)
    assert "target_hidden_size 96" in output and "hidden_size 64" in output


def test_draft_for_another_vocabulary_is_refused(tmp_path: Path, llama_target: Path) -> None:
    larger = write_tiny_target(tmp_path / "larger", TinyTargetSpec(vocab_size=384, num_layers=6))
    draft = write_tiny_eagle3(tmp_path / "draft", larger, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    output = serve_to_exit(llama_target, draft)
    assert "vocab_size 384" in output and "vocab_size 320" in output


def test_out_of_range_layer_ids_are_refused(tmp_path: Path, llama_target: Path) -> None:
    draft = write_tiny_eagle3(tmp_path / "draft", llama_target, TinyEagle3Spec(layer_ids=(1, 3, 9)))
    output = serve_to_exit(llama_target, draft)
    assert "aux capture index 10" in output and "0..6" in output


def test_missing_target_tensor_is_named(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec(num_layers=2))
    weights = load_file(str(target / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in serve_to_exit(target)


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec(num_layers=2))
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    assert "architectures: 'MambaForCausalLM' is not a supported target" in serve_to_exit(target)


@pytest.mark.parametrize("bad_tensor", ["fc.weight", "lm_head.weight"])
def test_draft_tensor_with_wrong_shape_is_named(tmp_path: Path, llama_target: Path, bad_tensor: str) -> None:
    draft = write_tiny_eagle3(tmp_path / "draft", llama_target, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    weights = load_file(str(draft / "model.safetensors"))
    weights[bad_tensor] = weights[bad_tensor][:, :-1].contiguous()
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    output = serve_to_exit(llama_target, draft)
    assert f"tensor {bad_tensor}" in output and "expected shape" in output


def test_mtp_layers_of_another_target_are_refused(tmp_path: Path, llama_target: Path) -> None:
    # MTP layers stored after a 4-layer target's last layer do not continue this 6-layer target.
    shorter = write_tiny_target(tmp_path / "shorter", TinyTargetSpec(num_layers=4))
    draft = write_tiny_chained_mtp(tmp_path / "mtp", shorter, TinyChainedMTPSpec(num_mtp_layers=2))
    output = serve_to_exit(llama_target, draft, "--speculative-num-steps", "2")
    assert "num_hidden_layers: the MTP checkpoint has 4, the target has 6" in output


def test_more_steps_than_mtp_layers_are_refused(tmp_path: Path, llama_target: Path) -> None:
    draft = write_tiny_chained_mtp(tmp_path / "mtp", llama_target, TinyChainedMTPSpec(num_mtp_layers=2))
    output = serve_to_exit(llama_target, draft, "--speculative-num-steps", "3")
    assert "3 draft steps, but the MTP draft has 2 layers" in output


def test_dflash_draft_that_does_not_fit_is_refused(tmp_path: Path, llama_target: Path) -> None:
    spec = TinyDFlashSpec(target_layer_ids=(1, 9), mask_token_id=500)
    output = serve_to_exit(llama_target, write_tiny_dflash(tmp_path / "draft", llama_target, spec))
    assert "target_layer_ids: the draft has [1, 9], the target has layers 0..5" in output
    assert "mask_token_id: the draft has 500, the target has vocab_size 320" in output


def test_unknown_draft_architecture_is_named(tmp_path: Path, llama_target: Path) -> None:
    draft = write_tiny_eagle3(tmp_path / "draft", llama_target, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    config = json.loads((draft / "config.json").read_text())
    config["architectures"] = ["MedusaModel"]
    (draft / "config.json").write_text(json.dumps(config))
    assert "architectures: 'MedusaModel' is not a draft this server runs" in serve_to_exit(llama_target, draft)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda would start")
@pytest.mark.parametrize("command", ["serve", "target", "draft"])
def test_device_cuda_without_cuda_stops_with_one_line(llama_target: Path, random_draft: Path, command: str) -> None:
    """Every command that computes refuses --device cuda on a machine without CUDA: one line, no traceback."""
    arguments = {
        "serve": ["serve", "--target", str(llama_target), "--draft", str(random_draft), "--port", "0"],
        "target": ["target", "--model", str(llama_target), "--port", "0"],
        "draft": ["draft", "--model", str(random_draft), "--target-address", "127.0.0.1:1", "--port", "0"],
    }[command]
    result = run_to_exit([*arguments, "--device", "cuda"], timeout_s=60)
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    assert f"{command} cannot start: --device cuda: CUDA is not available" in lines[0]
    assert "Traceback" not in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the flag would be accepted")
def test_flashinfer_backend_on_the_cpu_is_refused(llama_target: Path) -> None:
    result = run_to_exit(["target", "--model", str(llama_target), "--port", "0", "--attention-backend", "flashinfer"])
    assert result.returncode == 2, result.stdout
    assert "--attention-backend flashinfer: runs on CUDA in bfloat16 or float16, not on cpu in float32" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the flag could be accepted")
@pytest.mark.parametrize("command", ["target", "draft"])
def test_cuda_graphs_on_the_cpu_stop_with_one_line(llama_target: Path, random_draft: Path, command: str) -> None:
    arguments = {
        "target": ["target", "--model", str(llama_target), "--port", "0"],
        "draft": ["draft", "--model", str(random_draft), "--target-address", "127.0.0.1:1", "--port", "0"],
    }[command]
    result = run_to_exit([*arguments, "--cuda-graphs"], timeout_s=60)
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout, result.stdout
    assert (
        f"{command} cannot start: --cuda-graphs: graphs replay FlashInfer's attention on CUDA; this service runs on"
        " cpu with the torch attention backend"
    ) in lines[0]
