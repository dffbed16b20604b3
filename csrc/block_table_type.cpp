// kvcached_core._native.BlockTable: the Python type over kvcached::BlockTable.
//
// Written against the CPython API rather than pybind11: alloc() and free()
// are the KV block manager's hot path (one call per engine block request), and
// a METH_FASTCALL / METH_O method costs a fraction of pybind11's dispatch.
#include "block_table_type.h"

#include <Python.h>

#include <new>
#include <string>
#include <vector>

#include "backend.h"
#include "block_table.h"

namespace kvcached {

namespace {

struct PyBlockTable {
  PyObject_HEAD
  BlockTable* table;
};

// Sets the Python exception for a C++ failure (MappingError for bad input).
void set_error(const std::exception& e) {
  PyObject* errors = PyImport_ImportModule("kvcached_core.errors");
  PyObject* cls = errors ? PyObject_GetAttrString(errors, "MappingError") : nullptr;
  Py_XDECREF(errors);
  if (cls == nullptr) return;  // the import error stands
  PyErr_SetString(cls, e.what());
  Py_DECREF(cls);
}

bool ids_from(PyObject* seq, std::vector<std::int64_t>& ids) {
  PyObject* fast = PySequence_Fast(seq, "block ids must be a sequence of ints");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  ids.reserve(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(items[i]);
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    ids.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

PyObject* to_list(const std::vector<std::int64_t>& ids) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(ids.size()));
  if (list == nullptr) return nullptr;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(ids[i]);
    if (v == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), v);
  }
  return list;
}

BlockTable& table_of(PyObject* self) { return *reinterpret_cast<PyBlockTable*>(self)->table; }

PyObject* bt_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self) reinterpret_cast<PyBlockTable*>(self)->table = nullptr;
  return self;
}

int bt_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* kw[] = {"starts", "caps", "num_blocks", nullptr};
  PyObject *starts_obj, *caps_obj;
  long long num_blocks;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOL:BlockTable", const_cast<char**>(kw),
                                   &starts_obj, &caps_obj, &num_blocks)) {
    return -1;
  }
  std::vector<std::int64_t> starts, caps;
  if (!ids_from(starts_obj, starts) || !ids_from(caps_obj, caps)) return -1;
  try {
    auto* table = new BlockTable(std::move(starts), std::move(caps), num_blocks);
    auto* obj = reinterpret_cast<PyBlockTable*>(self);
    delete obj->table;
    obj->table = table;
  } catch (const std::exception& e) {
    set_error(e);
    return -1;
  }
  return 0;
}

void bt_dealloc(PyObject* self) {
  delete reinterpret_cast<PyBlockTable*>(self)->table;
  Py_TYPE(self)->tp_free(self);
}

bool ready(PyObject* self) {
  if (reinterpret_cast<PyBlockTable*>(self)->table) return true;
  PyErr_SetString(PyExc_RuntimeError, "BlockTable is not initialised");
  return false;
}

PyObject* bt_alloc(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  const long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  if (n < 0) return PyErr_Format(PyExc_ValueError, "cannot allocate %lld blocks", n);
  thread_local std::vector<std::int64_t> out;
  out.clear();
  if (!table_of(self).alloc(n, out)) Py_RETURN_NONE;
  return to_list(out);
}

PyObject* bt_free(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  thread_local std::vector<std::int64_t> ids, released;
  ids.clear();
  released.clear();
  if (!ids_from(arg, ids)) return nullptr;
  BlockTable& t = table_of(self);
  const std::string why = t.check_free(ids);
  if (!why.empty()) {
    set_error(Error(ErrorKind::kInvalidArgument, why));
    return nullptr;
  }
  t.free(ids, released);
  return to_list(released);
}

PyObject* bt_add_pages(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  std::vector<std::int64_t> pages;
  if (!ids_from(arg, pages)) return nullptr;
  try {
    table_of(self).add_pages(pages);
  } catch (const std::exception& e) {
    set_error(e);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* bt_release_idle(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  std::vector<std::int64_t> pages;
  if (!ids_from(arg, pages)) return nullptr;
  return to_list(table_of(self).release_idle(pages));
}

PyObject* bt_set_null(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  const long long b = PyLong_AsLongLong(arg);
  if (b == -1 && PyErr_Occurred()) return nullptr;
  try {
    table_of(self).set_null(b);
  } catch (const std::exception& e) {
    set_error(e);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* bt_available(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  const long long pages = PyLong_AsLongLong(arg);
  if (pages == -1 && PyErr_Occurred()) return nullptr;
  return PyLong_FromLongLong(table_of(self).available(pages));
}

PyObject* bt_page_occupancy(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  const long long page = PyLong_AsLongLong(arg);
  if (page == -1 && PyErr_Occurred()) return nullptr;
  try {
    return PyLong_FromLongLong(table_of(self).page_occupancy(page));
  } catch (const std::exception& e) {
    set_error(e);
    return nullptr;
  }
}

PyObject* bt_allocated_ids(PyObject* self, PyObject*) {
  if (!ready(self)) return nullptr;
  return to_list(table_of(self).allocated_ids());
}

PyObject* bt_is_allocated(PyObject* self, PyObject* arg) {
  if (!ready(self)) return nullptr;
  const long long b = PyLong_AsLongLong(arg);
  if (b == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(table_of(self).is_allocated(b));
}

PyObject* bt_free_in_pages(PyObject* self, void*) {
  if (!ready(self)) return nullptr;
  return PyLong_FromLongLong(table_of(self).free_in_pages());
}

PyObject* bt_held_pages(PyObject* self, void*) {
  if (!ready(self)) return nullptr;
  return PyLong_FromLongLong(table_of(self).held_pages());
}

PyObject* bt_num_allocated(PyObject* self, void*) {
  if (!ready(self)) return nullptr;
  return PyLong_FromLongLong(table_of(self).num_allocated());
}

PyMethodDef bt_methods[] = {
    {"alloc", bt_alloc, METH_O,
     "alloc(n): n block ids from held pages (best fit), or None when they hold fewer free "
     "blocks."},
    {"free", bt_free, METH_O,
     "free(ids): frees the blocks, all or nothing (MappingError names a bad id); returns the "
     "pages left with no allocated block, which are no longer held."},
    {"add_pages", bt_add_pages, METH_O, "add_pages(pages): start holding pages, all blocks free."},
    {"release_idle", bt_release_idle, METH_O,
     "release_idle(pages): of these, stop holding those with every block free; returns them."},
    {"set_null", bt_set_null, METH_O, "set_null(block): mark an allocated block never-freed."},
    {"available", bt_available, METH_O,
     "available(pages): blocks alloc() could give once `pages` more pages are held."},
    {"page_occupancy", bt_page_occupancy, METH_O,
     "page_occupancy(page): allocated blocks in the page (0 when not held)."},
    {"allocated_ids", bt_allocated_ids, METH_NOARGS,
     "allocated_ids(): allocated block ids, ascending, without the null block."},
    {"is_allocated", bt_is_allocated, METH_O, "is_allocated(block)"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef bt_getset[] = {
    {"free_in_pages", bt_free_in_pages, nullptr, "Free blocks in held pages.", nullptr},
    {"held_pages", bt_held_pages, nullptr, "Pages held (each with an allocated block).", nullptr},
    {"num_allocated", bt_num_allocated, nullptr, "Allocated blocks, null block excluded.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject bt_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "kvcached_core._native.BlockTable";
  t.tp_basicsize = sizeof(PyBlockTable);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc =
      "BlockTable(starts, caps, num_blocks): free blocks of held pages, picked best-fit "
      "(the KV block manager's core). Page p holds ids [starts[p], starts[p] + caps[p]).";
  t.tp_new = bt_new;
  t.tp_init = bt_init;
  t.tp_dealloc = bt_dealloc;
  t.tp_methods = bt_methods;
  t.tp_getset = bt_getset;
  return t;
}();

}  // namespace

bool add_block_table_type(PyObject* module) {
  if (PyType_Ready(&bt_type) < 0) return false;
  Py_INCREF(&bt_type);
  if (PyModule_AddObject(module, "BlockTable", reinterpret_cast<PyObject*>(&bt_type)) < 0) {
    Py_DECREF(&bt_type);
    return false;
  }
  return true;
}

}  // namespace kvcached
