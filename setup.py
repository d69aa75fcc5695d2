"""Install megatron_rl.

A plain ``pip install -e .`` compiles nothing. The CUDA kernels in ``csrc/`` are
built only when ``MEGATRON_RL_BUILD_CUDA=1`` is set and a CUDA toolkit plus a
CUDA build of torch are present; every kernel has a pure-torch path that gives
the same numbers, so the extension is an accelerator, never a requirement.

torch is deliberately given as a range that the CPU wheel 2.13.0 satisfies: on a
CPU machine install ``torch==2.13.0`` first (see README), otherwise pip fetches a
multi-GB CUDA build.
"""
import os

from setuptools import find_packages, setup

CORE_DEPS = [
    "torch>=2.6",
    # 0.17+ need Python 3.12; 0.16.1 is the newest for 3.11 and is what CI pins.
    "megatron-core>=0.16.1",
    "transformers>=4.51",
    "safetensors>=0.4",
    "numpy",
    "tqdm",
    "psutil",  # megatron dist_checkpointing's async writer imports it
    "pyyaml",
    "einops",
    "httpx",  # the SGLang client (megatron_rl/rollout/sglang/client.py)
]

EXTRAS = {
    "sglang": ["sglang"],
    "fp8": ["transformer-engine[pytorch]"],
    "wandb": ["wandb"],
    "ray": ["ray"],
    "tensorboard": ["tensorboard"],
    "plot": ["matplotlib"],
    "test": ["pytest>=8", "pytest-timeout", "hypothesis", "tensorboard", "matplotlib", "wandb",
             "import-linter>=2.1"],  # lint-imports: the layers contract in pyproject.toml
}
# NVIDIA apex is not on PyPI (the PyPI "apex" is an unrelated project): never list it.


def _ext_modules():
    if os.environ.get("MEGATRON_RL_BUILD_CUDA") != "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    srcs = [os.path.join("csrc", f) for f in sorted(os.listdir("csrc")) if f.endswith((".cu", ".cpp"))]
    if not srcs:
        return [], {}
    return [CUDAExtension("megatron_rl._C", srcs)], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Megatron-centric RL post-training engine for large language models",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=CORE_DEPS,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["megatron-rl-train=megatron_rl.train:main"]},
)
