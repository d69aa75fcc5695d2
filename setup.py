"""Install megatron_rl.

A plain ``pip install -e .`` on a CPU machine compiles nothing. The fused kernels
in ``csrc/`` are built according to ``MEGATRON_RL_BUILD_EXT`` (docs/kernels.md):

* ``auto`` (default): the CUDA extension ``megatron_rl._C`` when a CUDA build of
  torch and nvcc (``CUDA_HOME``) are both present, else nothing;
* ``cuda``: the CUDA extension, or a clear error saying what is missing;
* ``cpu``: the C++ CPU twins ``megatron_rl._C_cpu`` (the tests can also JIT them);
* ``none``: nothing.

Architectures: ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0``: A100, H100/H200).
Every kernel has a pure-torch path with the same numbers, so an extension is an
accelerator, never a requirement. Building one imports torch in setup.py, so use
``pip install -e . --no-build-isolation`` with torch already installed.

torch is deliberately given as a range that the CPU wheel 2.13.0 satisfies: on a
CPU machine install ``torch==2.13.0`` first (see README), otherwise pip fetches a
multi-GB CUDA build.
"""
import os

from setuptools import find_packages, setup

CORE_DEPS = [
    "torch>=2.6",
    # 0.16.1 is what CI runs (the newest for Python 3.11; 0.17+ need 3.12) and what the GPU check carries: the
    # CPU shim's patches are written against 0.16.x signatures (compat/patches.py refuses others), so no 0.17
    "megatron-core>=0.16.1,<0.17",
    "transformers>=4.51",
    "safetensors>=0.4",
    "numpy",
    "tqdm",
    "psutil",  # megatron dist_checkpointing's async writer imports it
    "pyyaml",
    "einops",
    "httpx",  # the SGLang client (megatron_rl/rollout/sglang/client.py)
    "pyarrow>=14",  # --prompt-data FILE.parquet: verl's data schema (megatron_rl/data/verl_parquet.py)
    "xxhash>=2.0",  # xxh3-128, the default --update-weight-delta-checksum (post-apply verification; 4.1.0 in CI)
    # ISA-L's CRC-32 (~11 GB/s vs zlib's ~2 on the 2-core VM): COMPLETE.json's checksums and the converters'
    # record CRCs (megatron_rl/infra/crc32.py falls back to zlib, same values, when it is missing)
    "isal==1.9.1",
]

EXTRAS = {
    "sglang": ["sglang"],
    "router": ["sglang-router"],  # an sglang-router in front of external servers (--rollout-engine-urls)
    "fp8": ["transformer-engine[pytorch]"],
    "wandb": ["wandb"],
    "ray": ["ray"],
    "tensorboard": ["tensorboard"],
    "plot": ["matplotlib"],
    "lora": ["peft"],  # --lora-rank on the FSDP backend: HF PEFT's adapters (the megatron backend needs none)
    "test": ["pytest>=8", "pytest-timeout",
             "pytest-xdist>=3.8",  # scripts/test.sh runs the suite on 2 workers, file by file
             "hypothesis", "tensorboard", "matplotlib", "wandb",
             "import-linter>=2.1",  # lint-imports: the layers contract in pyproject.toml
             "ruff==0.17.6",  # scripts/test.sh: `ruff check` ([tool.ruff] in pyproject.toml), pinned: new rules
             "mypy==2.4.1",  # scripts/test.sh: the type check ([tool.mypy] in pyproject.toml), pinned likewise
             "ninja",  # JIT build of the C++ CPU twins in tests/ops/test_cpu_ext.py
             # tests/ops/test_triton_kernels.py: the Triton kernels under its CPU interpreter and compiled for
             # sm_90 (the version the GPU machine has; CUDA builds of torch ship it, the CPU build does not)
             "triton==3.6.0",
             "sglang-router==0.3.2",  # tests/rollout/test_sglang_router.py: the real router before stand-ins
             # tests/e2e/test_slime_search_r1.py: slime's search-r1 example, unchanged, calls its retriever with it
             "aiohttp==3.14.5",
             # tests/rollout/test_agent_endpoint.py, tests/e2e/test_agent_endpoint.py: an agent written with the
             # official OpenAI client trains through --agent-function-path's endpoint, its calls unchanged
             "openai==3.51.0",
             "peft==0.21.2",  # tests/models/test_lora.py: our LoRA adapters against HF PEFT's on the HF model
             # tests/tools/test_launch_job.py: the JobSet tools/launch_job.py writes, against the JobSet v1alpha2 +
             # Kubernetes API models this package ships (pure Python over pydantic)
             "kubeflow-trainer-api==2.3.0"],
}
# NVIDIA apex is not on PyPI (the PyPI "apex" is an unrelated project): never list it.


BUILD_EXT_CHOICES = ("auto", "cuda", "cpu", "none")
CPU_CFLAGS = ["-O3", "-fopenmp"]  # as megatron_rl/ops/_ext.py's JIT build (at::parallel_for needs OpenMP)


def _sources(*subdirs):
    return ["csrc/bindings.cpp"] + [os.path.join("csrc", d, f) for d in subdirs
                                    for f in sorted(os.listdir(os.path.join("csrc", d)))
                                    if f.endswith((".cpp", ".cu"))]


def _cuda_toolchain_missing():
    """None when a CUDA torch and nvcc are both present, else what is missing."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "torch is not importable (install it first and use pip install --no-build-isolation)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return "nvcc was not found (set CUDA_HOME, e.g. CUDA_HOME=/usr/local/cuda)"
    return None


def _ext_modules():
    mode = os.environ.get("MEGATRON_RL_BUILD_EXT", "auto").strip() or "auto"
    if mode not in BUILD_EXT_CHOICES:
        raise SystemExit(f"MEGATRON_RL_BUILD_EXT={mode!r} is not one of {', '.join(BUILD_EXT_CHOICES)}")
    if mode == "none":
        return [], {}
    if mode == "auto":
        if not os.path.isdir("csrc") or _cuda_toolchain_missing():
            return [], {}  # a CPU machine: build nothing, fast
        mode = "cuda"
    if mode == "cuda":
        missing = _cuda_toolchain_missing()
        if missing:
            raise SystemExit(f"MEGATRON_RL_BUILD_EXT=cuda: cannot build the CUDA extension: {missing}")
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension

        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        ext = CUDAExtension("megatron_rl._C", _sources("cpu", "cuda"), define_macros=[("MRL_WITH_CUDA", None)],
                            extra_compile_args={"cxx": CPU_CFLAGS, "nvcc": ["-O3", "-DMRL_WITH_CUDA"]},
                            extra_link_args=["-fopenmp"])
        return [ext], {"build_ext": BuildExtension}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext = CppExtension("megatron_rl._C_cpu", _sources("cpu"), extra_compile_args={"cxx": CPU_CFLAGS},
                       extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


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
