from setuptools import find_packages, setup

setup(
    name="torch-fsdp-offload",
    version="0.1.0",
    description=(
        "CoherentOffload: fast, correct CPU offloading for PyTorch FSDP on unified, "
        "coherent (NVLink-C2C), PCIe-discrete and accelerator-less machines"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_fsdp_offload", "torch_fsdp_offload.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={
        "test": ["pytest", "expecttest", "parameterized", "numpy", "transformers", "matplotlib"],
        "plot": ["matplotlib"],
        # benchmarks/peers.py only: the systems it measures beside this library, never its dependency.
        "peers": ["deepspeed", "torchao"],
    },
    entry_points={"console_scripts": ["torch-fsdp-offload=torch_fsdp_offload.__main__:main"]},
    license="BSD-3-Clause",
)
