"""Gemma 4 assistants (Gemma4AssistantForCausalLM) for the tiny Gemma 4 targets, written with transformers' classes
and save_pretrained, and transformers' own assisted generation with them, round by round.

`write_fitted_assistant` fits the assistant to its target's greedy texts so that drafts are accepted in some rounds:
its hidden size is the target's, its layers' norms after attention and MLP are scaled down so that the residual
stream mostly passes through, pre_projection is the least-squares map from (scaled embedding of x[p + 1], the
target's normed hidden at p) to the target's normed hidden at p + 1, post_projection is the identity and the tied
table is the target's: the argmax of the logits then tends to be the target's next token. Every other weight stays
random.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import Gemma4TextConfig, PreTrainedModel
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from tests.helpers.gemma3_checkpoints import GLOBAL, LOCAL
from tests.helpers.gemma4_checkpoints import VOCAB, TinyGemma4Spec, gemma4_text_config, redraw_gemma4
from tests.helpers.step3p5_mtp_checkpoints import Rounds, recorded_rounds

LAYER_SCALE = 0.05  # the assistant layers' norms after attention and MLP are scaled by this


def assistant_config(spec: TinyGemma4Spec, centroids: bool = False) -> Gemma4AssistantConfig:
    """Two layers (a sliding and a full one) with the target's K/V geometry and hidden size."""
    target = gemma4_text_config(spec)
    text = Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=target.hidden_size,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=16,  # the tiny targets' sliding layers'
        global_head_dim=spec.global_head_dim,
        num_global_key_value_heads=spec.num_global_key_value_heads,
        attention_k_eq_v=spec.attention_k_eq_v,
        sliding_window=target.sliding_window,
        layer_types=[LOCAL, GLOBAL],
        rope_parameters=target.rope_parameters,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=None,
        dtype="float32",
    )
    ordered: dict[str, Any] = {"num_centroids": 8, "centroid_intermediate_top_k": 4} if centroids else {}
    return Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=target.hidden_size, use_ordered_embeddings=centroids, **ordered
    )


def greedy_texts(target: PreTrainedModel, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            target.generate(
                torch.tensor([list(prompt)]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
            )[0].tolist()
            for prompt in prompts
        ]


def write_fitted_assistant(
    directory: Path,
    spec: TinyGemma4Spec,
    target: PreTrainedModel,  # Gemma4ForCausalLM, or the multimodal Gemma4ForConditionalGeneration
    texts: Sequence[Sequence[int]],
    centroids: bool = False,
) -> Path:
    """An assistant fitted to the target's texts (module docstring), saved with save_pretrained."""
    with torch.random.fork_rng(devices=[]):
        assistant = Gemma4AssistantForCausalLM(assistant_config(spec, centroids)).eval()
    redraw_gemma4(assistant, seed=7)
    inputs, outputs = [], []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([list(text)])
            hidden = target(ids, output_hidden_states=True).hidden_states[-1][0]  # [n, hidden] normed
            embedded = target.get_input_embeddings()(ids)[0]  # scaled, as the assistant's input takes it
            inputs.append(torch.cat([embedded[1:], hidden[:-1]], dim=-1))
            outputs.append(hidden[1:])
        solution = torch.linalg.lstsq(torch.cat(inputs).double(), torch.cat(outputs).double()).solution
        assistant.pre_projection.weight.copy_(solution.T.float())
        assistant.post_projection.weight.copy_(torch.eye(assistant.config.backbone_hidden_size))
        assistant.model.norm.weight.fill_(1.0)
        assistant.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        for name, parameter in assistant.named_parameters():
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                parameter.mul_(LAYER_SCALE)
        if centroids:
            generator = torch.Generator().manual_seed(3)
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=generator))
    assistant.save_pretrained(directory, safe_serialization=True)
    return directory


def assisted_rounds(
    target: PreTrainedModel, assistant: PreTrainedModel, prompt: Sequence[int], new_tokens: int, steps: int
) -> Rounds:
    """transformers' greedy assisted generation with the assistant at a constant `steps`, each round's drafts
    recorded, the assistant reading the target's rows of verified tokens only.

    After a round that rejected a draft, transformers' candidate generator keeps one row of the verification pass
    past the verified tokens (the first rejected draft's K/V, at the position its drafts then sit at); Tandem never
    reads a rejected draft's row, so that row is dropped here (docs/drafting.md). Past the sliding window the
    sliding layer's shared rows are not position-aligned either: round by round comparisons use LONG_WINDOW."""
    assistant.generation_config.num_assistant_tokens = steps
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    generator = SinglePositionMultiTokenCandidateGenerator
    original = generator.get_candidates

    def verified_rows(self: Any, input_ids: torch.Tensor, model_kwargs: Any, model_outputs: Any, **kwargs: Any) -> Any:
        if model_outputs is not None and getattr(model_outputs, "shared_kv_states", None) is not None:
            rows = model_outputs.shared_kv_states
            extra = rows["full_attention"][0].shape[2] - (input_ids.shape[1] - 1)  # rows past the verified tokens
            if extra > 0:
                model_outputs.shared_kv_states = {
                    kind: (keys[:, :, :-extra], values[:, :, :-extra]) for kind, (keys, values) in rows.items()
                }
        return original(self, input_ids, model_kwargs=model_kwargs, model_outputs=model_outputs, **kwargs)

    with mock.patch.object(generator, "get_candidates", verified_rows):
        return recorded_rounds(generator, target, prompt, new_tokens, assistant_model=assistant)
