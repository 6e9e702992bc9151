"""distsim-harness: predict hybrid-parallel training iterations from profiled unique events."""
from setuptools import find_packages, setup

setup(
    name="distsim-harness",
    version="0.1.0",
    description=("Profile the unique events of a hybrid-parallel training job with MPI and rebuild every device's "
                 "timeline offline"),
    python_requires=">=3.11",
    packages=find_packages(include=["harness", "harness.*", "launcher", "launcher.*", "analysis", "analysis.*"]),
    package_data={"harness": ["jobs/*.toml", "plan/devices/*.toml"], "analysis": ["data/*.json"]},
    install_requires=[
        "torch>=2.3",
        "numpy>=1.26",
        "mpi4py>=4.0",
        "h5py>=3.10",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    extras_require={"test": ["pytest>=8", "pytest-mpi>=0.6", "hypothesis>=6"]},
    entry_points={
        "console_scripts": [
            "distsim-harness=harness.__main__:main",
            "distsim-analysis=analysis.__main__:main",
        ]
    },
)
