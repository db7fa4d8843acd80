# find_package(multipy) config: defines multipy::runtime, the C++ API of multipy
# (multipy/runtime/deploy.h), built from the sources shipped in the installed package,
# inside the project that finds it.  Give CMake the prefixes with
#   cmake -DCMAKE_PREFIX_PATH="$(multipy cmake-prefix)" ...
# Variables it reads (all optional):
#   MULTIPY_PYTHON_EXECUTABLE  the python that multipy and torch are installed for; by
#                              default the one whose site-packages holds the Torch that
#                              find_package(Torch) finds, else $VIRTUAL_ENV's.
# docs/cpp.md explains why the library is built here rather than at pip install.
if(TARGET multipy::runtime)
  return()
endif()
cmake_minimum_required(VERSION 3.18)

set(_multipy_dir "${CMAKE_CURRENT_LIST_DIR}")

if(NOT TARGET torch)
  find_package(Torch REQUIRED)
endif()

# The python multipy runs on: the host CPython that the library embeds.
if(NOT MULTIPY_PYTHON_EXECUTABLE)
  set(_multipy_candidates)
  if(TORCH_INSTALL_PREFIX)
    # .../lib/pythonX.Y/site-packages/torch -> .../bin/python3 (a venv or a prefix)
    get_filename_component(_multipy_root "${TORCH_INSTALL_PREFIX}/../../../.." ABSOLUTE)
    list(APPEND _multipy_candidates "${_multipy_root}/bin/python3" "${_multipy_root}/bin/python")
  endif()
  if(DEFINED ENV{VIRTUAL_ENV})
    list(APPEND _multipy_candidates "$ENV{VIRTUAL_ENV}/bin/python3")
  endif()
  foreach(_multipy_python IN LISTS _multipy_candidates)
    if(EXISTS "${_multipy_python}")
      execute_process(COMMAND "${_multipy_python}" -c "import multipy, torch"
                      RESULT_VARIABLE _multipy_status OUTPUT_QUIET ERROR_QUIET)
      if(_multipy_status EQUAL 0)
        set(MULTIPY_PYTHON_EXECUTABLE "${_multipy_python}")
        break()
      endif()
    endif()
  endforeach()
  if(NOT MULTIPY_PYTHON_EXECUTABLE)
    message(FATAL_ERROR "multipy: found no python that imports multipy and torch (tried: "
            "${_multipy_candidates}); pass -DMULTIPY_PYTHON_EXECUTABLE=/path/to/python")
  endif()
endif()
set(MULTIPY_PYTHON_EXECUTABLE "${MULTIPY_PYTHON_EXECUTABLE}" CACHE FILEPATH
    "The python that multipy::runtime embeds (multipy and torch installed for it)")

# Its headers and shared libpython (Development.Embed), found through that python.
set(Python3_EXECUTABLE "${MULTIPY_PYTHON_EXECUTABLE}" CACHE FILEPATH "" FORCE)
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Embed)

# torch's Python bindings (THPVariable_Wrap/Unpack): tensors cross without copies.
find_library(MULTIPY_TORCH_PYTHON_LIBRARY torch_python
             PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)

add_library(multipy_runtime STATIC "${_multipy_dir}/src/deploy.cpp")
add_library(multipy::runtime ALIAS multipy_runtime)
# torch (TorchConfig.cmake) is built as C++20, and its headers need it from 2.14 on.
target_compile_features(multipy_runtime PUBLIC cxx_std_20)
set_target_properties(multipy_runtime PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(multipy_runtime PUBLIC "${_multipy_dir}/include")
target_compile_definitions(multipy_runtime PRIVATE
                           MULTIPY_PYTHON_EXECUTABLE="${MULTIPY_PYTHON_EXECUTABLE}")
target_link_libraries(multipy_runtime PUBLIC ${TORCH_LIBRARIES}
                      PRIVATE Python3::Python "${MULTIPY_TORCH_PYTHON_LIBRARY}")
set(multipy_FOUND TRUE)
