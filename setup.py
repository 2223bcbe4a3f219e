"""Installs the ``ppd`` library (Parallel Prompt Decoding).

Only ``ppd`` is a package; ``data_gen``, ``train``, ``eval`` and ``application`` are programs run from the
repository root with ``python -m``. ``make install`` is the supported way to set up a development copy:
it installs a CPU build of torch first so that pip never pulls CUDA wheels on a machine without a GPU.
"""

from setuptools import find_packages, setup

setup(
    name="ppd",
    version="0.1.0",
    description="Parallel Prompt Decoding: lossless multi-token decoding with trained prompt tokens",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ppd", "ppd.*"]),
    package_data={"ppd": ["trees/*.json", "adapters/*/*.json", "adapters/*/*.safetensors", "adapters/*/*.md"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17",
        "safetensors>=0.4",
        "gguf>=0.10",
        "numpy",
        "tqdm",
    ],
    extras_require={
        "train": ["peft>=0.13", "accelerate>=1.0", "bitsandbytes>=0.45", "datasets>=3.0"],
        # httptools and uvloop: uvicorn's C HTTP parser and event loop, which it picks where installed (the
        # server's cost per streamed chunk, results/server_host/)
        "app": ["gradio>=5.0", "fastapi>=0.110", "uvicorn>=0.29", "httptools>=0.6",
                "uvloop>=0.19; sys_platform != 'win32'"],
        "eval": ["matplotlib>=3.7", "httpx>=0.27"],
        # triton: the split attention kernel's tests run it on CPU under Triton's interpreter
        "test": ["pytest>=8", "pytest-xdist>=3.5", "playwright>=1.40", "httpx>=0.27",
                 "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    },
)
