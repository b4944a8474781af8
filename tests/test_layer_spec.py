"""`ActorConfig.layer_spec` (auto | te | local): Transformer Engine is used, absent, or broken -- never silently.

The TE cases run on CPU against stand-in `transformer_engine` packages written to a temporary
directory: the real question is only what `import transformer_engine.pytorch` does.
"""

from __future__ import annotations

import logging
import sys

import pytest

pytest.importorskip("megatron.core")

from megatron_bapo.models.layer_spec import resolve_layer_spec  # noqa: E402
from test_actor_helpers import TINY_QWEN2  # noqa: E402

FAKES = {
    "working": {"__init__.py": "", "pytorch/__init__.py": "VERSION = 'stand-in'\n"},
    "meta-package": {"__init__.py": ""},  # what `pip install transformer-engine` alone gives
    "driver mismatch": {"__init__.py": "", "pytorch/__init__.py":
                        "raise OSError('libcudart.so.12: cannot open shared object file: No such file or directory')\n"},
    "missing extension": {"__init__.py": "", "pytorch/__init__.py": "import transformer_engine_torch\n"},
}


@pytest.fixture
def fake_te(tmp_path, monkeypatch):
    """Install the named stand-in package (None: none at all) for the duration of a test."""

    def install(kind):
        for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
            monkeypatch.delitem(sys.modules, name)
        if kind is None:
            return
        root = tmp_path / kind.replace(" ", "_")
        for rel, text in FAKES[kind].items():
            path = root / "transformer_engine" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        monkeypatch.syspath_prepend(str(root))

    yield install
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        sys.modules.pop(name)


def test_local_and_no_cuda_need_no_transformer_engine(fake_te):
    fake_te("driver mismatch")  # never imported on these paths
    assert resolve_layer_spec("local", cuda=True).use_te is False
    auto = resolve_layer_spec("auto", cuda=False)
    assert (auto.use_te, auto.reason) == (False, "no CUDA")
    with pytest.raises(ValueError, match=r"layer_spec='te' needs CUDA"):
        resolve_layer_spec("te", cuda=False)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_layer_spec("apex")


@pytest.mark.parametrize("kind", [None, "meta-package"])
def test_absent_transformer_engine_gives_the_local_spec_and_says_why(fake_te, kind):
    fake_te(kind)
    auto = resolve_layer_spec("auto", cuda=True)
    assert auto.use_te is False and "Transformer Engine is not installed" in auto.reason
    with pytest.raises(ValueError, match=r"layer_spec='te': Transformer Engine is not installed.*actor.layer_spec=local"):
        resolve_layer_spec("te", cuda=True)


@pytest.mark.parametrize("kind, message", [("driver mismatch", "OSError: libcudart.so.12: cannot open shared object"),
                                           ("missing extension", "No module named 'transformer_engine_torch'")])
def test_broken_transformer_engine_is_an_error_with_its_message(fake_te, kind, message):
    fake_te(kind)
    for choice in ("auto", "te"):
        with pytest.raises(ValueError) as exc:
            resolve_layer_spec(choice, cuda=True)
        assert f"layer_spec={choice!r}: Transformer Engine is installed but does not import" in str(exc.value)
        assert message in str(exc.value) and "actor.layer_spec=local" in str(exc.value)


def test_working_transformer_engine_is_chosen_by_auto(fake_te):
    fake_te("working")
    assert resolve_layer_spec("auto", cuda=True).use_te is True
    assert resolve_layer_spec("te", cuda=True).use_te is True


def _build(rank, world_size, cp):
    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    actor_logs = logging.getLogger("megatron_bapo.actor")  # the package: actor/build.py says it
    actor_logs.addHandler(handler)
    actor_logs.setLevel(logging.INFO)
    actor = Actor(ActorConfig(parallel=ParallelConfig(cp=cp), layer_spec="local"), TINY_QWEN2)
    core = type(actor.model[0].module.decoder.layers[0].self_attention.core_attention).__name__
    return [m for m in records if m.startswith("model:")], core


def test_the_actor_says_which_spec_attention_and_context_parallel_run(run_dist):
    for lines, core in run_dist(_build, 2, 2, timeout=120):
        assert core == "SdpaAttention"
        assert lines == ["model: local layer spec (actor.layer_spec=local); attention SdpaAttention (torch SDPA; "
                         "packed sequences bucketed per length, dense masks under CP), all-gather of K/V over the "
                         "CP group; fusions: none"]


def _fusion_config(rank, world_size):
    from megatron_bapo.models.builder import gpu_fusions, transformer_config_from_hf
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig())
    fusions = gpu_fusions(use_te=False)
    config, _ = transformer_config_from_hf(TINY_QWEN2, **fusions)  # megatron validates the combination
    return fusions, {k: getattr(config, k) for k in fusions}, gpu_fusions(use_te=True)


def test_gpu_fusions_are_ones_megatron_accepts_for_our_models(run_dist):
    """On a CUDA machine the builder turns these on (the registry's defaults keep them off for CPU)."""
    fusions, applied, with_te = run_dist(_fusion_config, 1, timeout=60)[0]
    # this machine has no Apex: no fused weight-gradient accumulation; TE adds the fused RoPE
    assert fusions == applied == {"bias_activation_fusion": True, "bias_dropout_fusion": True}
    assert with_te == {**fusions, "apply_rope_fusion": True}
