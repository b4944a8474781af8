"""YAML + dotted overrides -> nested dataclasses, with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest

from megatron_bapo.algorithms import BapoConfig
from megatron_bapo.config_io import ConfigError, load_config, to_dict


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10
    name: Optional[str] = None


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    bapo: BapoConfig = field(default_factory=BapoConfig)
    tags: list[str] = field(default_factory=list)
    enabled: bool = True


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  lr: 2e-6\n  steps: 3\nbapo:\n  rho0: 0.5\ntags: [a, b]\n")
    cfg = load_config(Outer, path, ["inner.steps=7", "bapo.dual_clip=null", "inner.name=run1", "enabled=false"])
    assert cfg.inner == Inner(lr=2e-6, steps=7, name="run1")
    assert cfg.bapo.rho0 == 0.5 and cfg.bapo.dual_clip is None
    assert cfg.tags == ["a", "b"] and cfg.enabled is False
    assert to_dict(cfg)["inner"]["steps"] == 7


@pytest.mark.parametrize(
    "override, needle",
    [
        ("inner.stpes=3", "inner.stpes"),
        ("inner.steps=three", "inner.steps"),
        ("inner.steps=1.5", "inner.steps"),
        ("enabled=3", "enabled"),
        ("bapo.low_start=0.95", "low_start"),
        ("inner=3", "inner"),
        ("noequals", "key.sub=value"),
    ],
)
def test_errors_name_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(Outer, None, [override])
