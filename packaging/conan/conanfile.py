"""Conan 2 recipe of fsdp: a header-only library whose CMake install (headers, fsdpConfig.cmake
with its components) is the package. Consumers find it with find_package(fsdp CONFIG REQUIRED
[COMPONENTS mpi cuda nccl]) through fsdp's own package config, so the build and the package
describe dependencies in one place (cmake/fsdpDependencies.cmake).

Its dependencies (the CUDA toolkit's headers with CCCL, nlohmann-json, xxHash, and for the
options an MPI or nvcc and NCCL) are system packages that the config finds; ConanCenter is not
needed: `conan create packaging/conan -s compiler.cppstd=20` runs offline. docs/install.md."""
import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load
from conan.tools.system.package_manager import Apt


class FsdpConan(ConanFile):
    name = "fsdp"
    description = "Fully Sharded Data Parallel training for C++ engines: header-only, policy-based"
    topics = ("fsdp", "distributed-training", "header-only", "cuda", "mpi")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    # The backends beyond threads, as fsdp's CMake components: mpi -> fsdp::mpi, cuda -> fsdp::cuda
    # and fsdp::nccl (with nvcc; NCCL when found).
    options = {"with_mpi": [True, False], "with_cuda": [True, False]}
    default_options = {"with_mpi": True, "with_cuda": False}
    no_copy_source = True

    def set_version(self):
        # One version: the project's (CMakeLists.txt, project(fsdp VERSION x.y.z)).
        text = load(self, os.path.join(self.recipe_folder, "..", "..", "CMakeLists.txt"))
        self.version = re.search(r"project\(fsdp VERSION ([0-9.]+)", text).group(1)

    def export_sources(self):
        root = os.path.join(self.recipe_folder, "..", "..")
        for pattern in ("CMakeLists.txt", "include/*", "cmake/*"):
            copy(self, pattern, root, self.export_sources_folder)

    def layout(self):
        cmake_layout(self)

    def validate(self):
        check_min_cppstd(self, 20)

    def system_requirements(self):
        # What fsdp's package config looks for (Debian/Ubuntu names); installed only when asked
        # (conan ... -c tools.system.package_manager:mode=install), checked otherwise.
        packages = ["nlohmann-json3-dev", "libxxhash-dev"]
        if self.options.with_mpi:
            packages.append("libopenmpi-dev")
        Apt(self).install(packages)

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables["FSDP_BUILD_TESTS"] = False
        tc.cache_variables["FSDP_BUILD_EXAMPLES"] = False
        tc.cache_variables["FSDP_BUILD_BENCH"] = False
        tc.cache_variables["FSDP_MPI"] = bool(self.options.with_mpi)
        tc.cache_variables["FSDP_CUDA"] = bool(self.options.with_cuda)
        tc.generate()

    def package(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.install()

    def package_id(self):
        # Headers only: the compiler, build type and platform do not change the package. The
        # options do (they decide which component targets are installed), so they stay.
        self.info.settings.clear()

    def package_info(self):
        # fsdp's own config, not one Conan generates: it finds the system dependencies and
        # gives the components (fsdp::mpi, fsdp::cuda, fsdp::nccl).
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs = [os.path.join("lib", "cmake", "fsdp")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
