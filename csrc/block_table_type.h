// Registers kvcached_core._native.BlockTable (a CPython type over BlockTable).
#pragma once

#include <Python.h>

namespace kvcached {

// Adds the type to the module; false with a Python exception set on failure.
bool add_block_table_type(PyObject* module);

}  // namespace kvcached
