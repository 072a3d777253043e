"""Tests for the built-in models (torch_fsdp_offload.models)."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import unittest

import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_fsdp_offload.models import (
    MODEL_CONFIGS,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    build_hf_causal_lm,
    build_model,
    causal_lm_loss,
    find_blocks,
)

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class TestTransformer(TestCase):
    def test_forward_shapes_and_layout(self) -> None:
        model = build_model("tiny")
        config = model.config
        tokens = torch.randint(0, config.vocab_size, (3, 17))
        logits = model(tokens)
        self.assertEqual(logits.shape, (3, 17, config.vocab_size))
        self.assertIsInstance(model.blocks, torch.nn.ModuleList)
        self.assertEqual(len(model.blocks), config.n_layers)
        self.assertTrue(all(isinstance(block, TransformerBlock) for block in model.blocks))
        for name in ("tok_embeddings", "norm", "output"):
            self.assertTrue(hasattr(model, name))

    def test_causal(self) -> None:
        # Changing a later token must not change earlier logits.
        model = build_model("tiny")
        tokens = torch.randint(0, 256, (1, 12))
        changed = tokens.clone()
        changed[0, 8] = (changed[0, 8] + 1) % 256
        self.assertEqual(model(tokens)[:, :8], model(changed)[:, :8])
        self.assertNotEqual(model(tokens)[:, 8:], model(changed)[:, 8:])

    @parametrize("name", ["tiny", "anchor-small"])
    def test_init_deterministic_after_to_empty(self, name: str) -> None:
        config = MODEL_CONFIGS["tiny"]
        if name == "anchor-small":
            # The anchor family (LayerNorm, GELU, no RoPE) at a CPU-friendly size.
            config = TransformerConfig(
                vocab_size=32, dim=64, n_layers=2, n_heads=4, ffn_hidden=256, max_seq_len=64,
                norm="layer", mlp="gelu", rope=False,
            )
        eager = build_model(config)
        deferred = build_model(config, device="meta")
        deferred.to_empty(device="cpu")
        deferred.init_weights(seed=0)
        for (name_a, a), (name_b, b) in zip(eager.state_dict().items(), deferred.state_dict().items()):
            self.assertEqual(name_a, name_b)
            self.assertEqual(a, b, atol=0, rtol=0)
        deferred.init_weights(seed=1)
        self.assertNotEqual(eager.output.weight, deferred.output.weight)
        tokens = torch.randint(0, config.vocab_size, (2, 8))
        deferred.init_weights(seed=0)
        self.assertEqual(eager(tokens), deferred(tokens), atol=0, rtol=0)

    def test_rope_tables_restored_after_to_empty(self) -> None:
        model = build_model("tiny", device="meta")
        model.to_empty(device="cpu")
        model.reset_parameters()
        self.assertEqual(model.rope_cos, build_model("tiny").rope_cos)

    def test_dtype(self) -> None:
        model = build_model("tiny", dtype=torch.bfloat16)
        self.assertTrue(all(p.dtype == torch.bfloat16 for p in model.parameters()))
        self.assertEqual(model.rope_cos.dtype, torch.float32)
        self.assertEqual(model(torch.randint(0, 256, (1, 8))).dtype, torch.bfloat16)

    def test_anchor_param_count_on_meta(self) -> None:
        model = build_model("anchor-1.6b", device="meta")
        self.assertTrue(all(p.is_meta for p in model.parameters()))
        # The benchmark model of docs/benchmarks.md: 1611.0M parameters.
        self.assertEqual(model.param_count(), 1_611_014_144)
        config = model.config
        self.assertEqual((config.n_layers, config.dim, config.norm, config.mlp), (8, 4096, "layer", "gelu"))

    def test_llama_1b_param_count_on_meta(self) -> None:
        self.assertEqual(build_model("llama-1b", device="meta").param_count(), 1_498_482_688)

    def test_loss_and_training_step(self) -> None:
        model = build_model("tiny")
        tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss = causal_lm_loss(model(tokens), tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        # Random init over 256 tokens starts near ln(256); fitting one batch lowers it.
        self.assertLess(abs(losses[0] - torch.log(torch.tensor(256.0)).item()), 0.5)
        self.assertLess(losses[-1], losses[0])

    def test_errors(self) -> None:
        with self.assertRaisesRegex(KeyError, "unknown model 'nope'.*tiny"):
            build_model("nope")
        with self.assertRaisesRegex(TypeError, "TransformerConfig"):
            build_model(3)
        with self.assertRaisesRegex(ValueError, "divisible by n_heads"):
            TransformerConfig(vocab_size=8, dim=10, n_layers=1, n_heads=3, ffn_hidden=8, max_seq_len=8)
        with self.assertRaisesRegex(ValueError, "norm must be"):
            TransformerConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, ffn_hidden=8, max_seq_len=8, norm="batch")
        model = build_model("tiny")
        with self.assertRaisesRegex(ValueError, "exceeds max_seq_len"):
            model(torch.zeros(1, 257, dtype=torch.long))
        with self.assertRaisesRegex(ValueError, "seq >= 2"):
            causal_lm_loss(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long))


def _stack(n_blocks: int, width: int = 0) -> torch.nn.Module:
    """A module with ``n_blocks`` blocks, each holding a list of ``width`` experts when ``width``."""
    blocks = []
    for _ in range(n_blocks):
        blocks.append(torch.nn.Module())
        if width:
            blocks[-1].experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(width))
    return torch.nn.ModuleList(blocks)


class TestFindBlocks(TestCase):
    def test_known_layouts(self) -> None:
        model = build_model("tiny", device="meta")
        self.assertIs(find_blocks(model), model.blocks)
        gpt2_like = torch.nn.Module()
        gpt2_like.transformer = torch.nn.Module()
        gpt2_like.transformer.h = _stack(3)
        gpt2_like.head = _stack(1)
        self.assertIs(find_blocks(gpt2_like), gpt2_like.transformer.h)

    @unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
    def test_transformers_model(self) -> None:
        model = build_hf_causal_lm("llama-tiny", device="meta")
        self.assertIs(find_blocks(model), model.model.layers)

    def test_longest_outermost_list_elsewhere(self) -> None:
        # Four blocks of eight experts each under a name no layout uses: the experts are longer but
        # inside the blocks, so they are not the blocks.
        model = torch.nn.Module()
        model.decoder = torch.nn.Module()
        model.decoder.stack = _stack(4, width=8)
        model.heads = _stack(2)
        self.assertIs(find_blocks(model), model.decoder.stack)

    def test_given_blocks_by_module_or_name(self) -> None:
        model = build_model("tiny", device="meta")
        by_module = find_blocks(model, [model.blocks[1], model.blocks[0]])
        self.assertEqual([id(block) for block in by_module], [id(model.blocks[1]), id(model.blocks[0])])
        # Names find the same blocks in a copy of the model (the planner plans on one).
        by_name = find_blocks(model, ["blocks.0", "output"])
        self.assertIs(by_name[0], model.blocks[0])
        self.assertIs(by_name[1], model.output)
        with self.assertRaisesRegex(ValueError, "names 'blocks.7', which is no submodule of Transformer"):
            find_blocks(model, ["blocks.7"])
        with self.assertRaisesRegex(ValueError, "holds a Linear that is no submodule of Transformer"):
            find_blocks(model, [torch.nn.Linear(2, 2)])
        with self.assertRaisesRegex(ValueError, "blocks= is empty"):
            find_blocks(model, [])
        with self.assertRaisesRegex(ValueError, "holds 'blocks.0' twice"):
            find_blocks(model, [model.blocks[0], "blocks.0"])
        with self.assertRaisesRegex(ValueError, "'blocks.0' and 'blocks.0.attention', one inside the other"):
            find_blocks(model, ["blocks.0", "blocks.0.attention"])

    def test_no_or_ambiguous_blocks_are_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "Linear has no non-empty nn.ModuleList of blocks.*pass blocks="):
            find_blocks(torch.nn.Linear(2, 2))
        empty = torch.nn.Module()
        empty.blocks = torch.nn.ModuleList()
        with self.assertRaisesRegex(ValueError, "no non-empty nn.ModuleList"):
            find_blocks(empty)
        encoder_decoder = torch.nn.Module()
        encoder_decoder.encoder, encoder_decoder.decoder = _stack(3), _stack(3)
        with self.assertRaisesRegex(ValueError, r"2 nn.ModuleLists of 3 modules \(encoder, decoder\).*ambiguous.*blocks="):
            find_blocks(encoder_decoder)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
class TestHFCausalLM(TestCase):
    def test_builtin_config(self) -> None:
        model = build_hf_causal_lm("llama-tiny")
        self.assertEqual(model(torch.randint(0, 256, (1, 8))).logits.shape, (1, 8, 256))

    def test_json_string_and_file_on_meta(self) -> None:
        config = {
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2,
        }
        model = build_hf_causal_lm(json.dumps(config), device="meta", dtype=torch.bfloat16)
        param = next(model.parameters())
        self.assertTrue(param.is_meta)
        self.assertEqual(param.dtype, torch.bfloat16)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "config.json")
            with open(path, "w") as f:
                json.dump(config, f)
            self.assertEqual(build_hf_causal_lm(path).config.vocab_size, 64)

    def test_missing_model_type(self) -> None:
        with self.assertRaisesRegex(ValueError, "model_type"):
            build_hf_causal_lm({"vocab_size": 8})


instantiate_parametrized_tests(TestTransformer)

if __name__ == "__main__":
    run_tests()
