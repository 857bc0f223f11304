# LibTorch from the installed `torch` Python package, as imported targets.
# We do not use find_package(Torch): its config requires a CUDA toolkit whenever torch was built
# with CUDA, which would break the CPU-only build.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch.compiled_with_cxx11_abi())); print(torch.__version__); print(int(torch.version.cuda is not None)); print(torch.version.cuda or 'none')"
  OUTPUT_VARIABLE _kg_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _kg_rc)
if(NOT _kg_rc EQUAL 0)
  message(FATAL_ERROR "kernelgate needs the `torch` Python package in ${Python3_EXECUTABLE}; "
                      "install it first (see README.md)")
endif()
string(REPLACE "\n" ";" _kg_torch_info "${_kg_torch_info}")
list(GET _kg_torch_info 0 KG_TORCH_DIR)
list(GET _kg_torch_info 1 KG_TORCH_CXX11_ABI)
list(GET _kg_torch_info 2 KG_TORCH_VERSION)
list(GET _kg_torch_info 3 KG_TORCH_HAS_CUDA)
list(GET _kg_torch_info 4 KG_TORCH_CUDA)
message(STATUS "kernelgate: torch ${KG_TORCH_VERSION} at ${KG_TORCH_DIR}")
set(KG_TORCH_LIB_DIR "${KG_TORCH_DIR}/lib")

add_library(kg_torch INTERFACE)
target_include_directories(kg_torch SYSTEM INTERFACE "${KG_TORCH_DIR}/include"
                                                     "${KG_TORCH_DIR}/include/torch/csrc/api/include")
target_compile_definitions(kg_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${KG_TORCH_CXX11_ABI})
target_link_libraries(kg_torch INTERFACE "${KG_TORCH_LIB_DIR}/libtorch.so"
                      "${KG_TORCH_LIB_DIR}/libtorch_cpu.so" "${KG_TORCH_LIB_DIR}/libc10.so")
target_link_directories(kg_torch INTERFACE "${KG_TORCH_LIB_DIR}")

add_library(kg_torch_cuda INTERFACE)
if(KG_TORCH_HAS_CUDA)
  target_link_libraries(kg_torch_cuda INTERFACE "${KG_TORCH_LIB_DIR}/libtorch_cuda.so"
                        "${KG_TORCH_LIB_DIR}/libc10_cuda.so")
endif()

add_library(kg_torch_python INTERFACE)
target_link_libraries(kg_torch_python INTERFACE "${KG_TORCH_LIB_DIR}/libtorch_python.so"
                      Python3::Module)
