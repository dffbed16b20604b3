// Python bindings: module kvcached_core._native.
//
// Memory reaches Python as DLPack capsules, so this extension never links
// against torch. Every call that can block on the driver releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend.h"
#include "faults.h"
#include "block_table_type.h"
#include "page_mapper.h"
#include "page_server.h"
#include "protocol.h"
#include "raw_timing.h"

namespace py = pybind11;
using namespace kvcached;

namespace {

PyObject* python_error_for(ErrorKind kind) {
  static const char* names[] = {"DeviceError", "DeviceOutOfMemoryError",
                                "BackendUnavailableError", "MappingError",
                                "ForkedProcessError"};
  py::module_ errors = py::module_::import("kvcached_core.errors");
  return errors.attr(names[static_cast<int>(kind)]).ptr();
}

void delete_unconsumed_capsule(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and owns the tensor;
  // only an unconsumed capsule still holds it here.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed =
        static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (managed && managed->deleter) managed->deleter(managed);
  }
}

py::object to_capsule(const std::shared_ptr<VirtualTensor>& self) {
  DLManagedTensor* managed = VirtualTensor::to_dlpack(self);
  PyObject* cap = PyCapsule_New(managed, "dltensor", delete_unconsumed_capsule);
  if (cap == nullptr) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvcached native page mapper (CUDA, HIP and host VMM backends)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(python_error_for(e.kind()), e.what());
    }
  });

  {  // The IPC wire protocol as compiled in (protocol.h), for the test that
     // holds it equal to kvcached_core/ipc/protocol.py.
    namespace wire = protocol;
    py::dict p;
    p["magic"] = py::bytes(wire::kMagic, sizeof wire::kMagic);
    p["version"] = wire::kVersion;
    p["header_size"] = wire::kHeaderSize;
    p["reply_bit"] = wire::kReplyBit;
    p["max_count"] = wire::kMaxCount;
    p["max_text"] = wire::kMaxText;
    py::dict offsets;
    offsets["version"] = wire::kOffVersion;
    offsets["type"] = wire::kOffType;
    offsets["status"] = wire::kOffStatus;
    offsets["request_id"] = wire::kOffRequestId;
    offsets["group"] = wire::kOffGroup;
    offsets["count"] = wire::kOffCount;
    offsets["text_len"] = wire::kOffTextLen;
    p["offsets"] = offsets;
    py::dict types;
    types["HELLO"] = wire::kTypeHello;
    types["PING"] = wire::kTypePing;
    types["MAP"] = wire::kTypeMap;
    types["UNMAP"] = wire::kTypeUnmap;
    types["QUERY"] = wire::kTypeQuery;
    types["MEMINFO"] = wire::kTypeMemInfo;
    p["types"] = types;
    py::dict statuses;
    statuses["OK"] = wire::kStatusOk;
    statuses["ERROR"] = wire::kStatusError;
    statuses["BAD_REQUEST"] = wire::kStatusBadRequest;
    statuses["OUT_OF_MEMORY"] = wire::kStatusOutOfMemory;
    p["statuses"] = statuses;
    m.attr("PROTOCOL") = p;
  }

  m.def("compiled_backends", &compiled_backends,
        "Backends compiled into this build, in preference order.");

  m.def(
      "probe_backend",
      [](const std::string& backend) {
        SymbolReport r = probe_backend(backend);
        py::dict out;
        out["library"] = r.library;
        out["load_error"] = r.load_error;
        out["symbols"] = r.symbols;
        return out;
      },
      py::arg("backend"),
      "Loads a GPU backend's driver library (no device needed) and reports, for "
      "each entry point of its symbol table, whether it resolved.");

  py::class_<VirtualTensor, std::shared_ptr<VirtualTensor>>(m, "VirtualTensor")
      .def_property_readonly("address", &VirtualTensor::address)
      .def_property_readonly("size", &VirtualTensor::size)
      .def_property_readonly("num_pages", &VirtualTensor::num_pages)
      .def_property_readonly("mapped_pages", &VirtualTensor::mapped_pages)
      .def("is_mapped", &VirtualTensor::is_mapped, py::arg("page"))
      .def("dlpack", &to_capsule,
           "A DLPack capsule of `size` uint8 bytes over the reservation.")
      .def("__repr__", [](const VirtualTensor& t) {
        return "<VirtualTensor " + hex(t.address()) + " size=" +
               std::to_string(t.size()) + " mapped=" +
               std::to_string(t.mapped_pages()) + "/" +
               std::to_string(t.num_pages()) + ">";
      });

  py::class_<MapperStats>(m, "MapperStats")
      .def_readonly("mapped_pages", &MapperStats::mapped_pages)
      .def_readonly("pooled_handles", &MapperStats::pooled_handles)
      .def_readonly("handles_created", &MapperStats::handles_created)
      .def_readonly("handles_released", &MapperStats::handles_released)
      .def_readonly("pool_limit", &MapperStats::pool_limit);

  py::class_<PageGroup>(m, "PageGroup",
                        "Virtual tensors mapped and unmapped together; calls take pages only.")
      .def("map", &PageGroup::map, py::arg("pages"),
           py::call_guard<py::gil_scoped_release>())
      .def("unmap", &PageGroup::unmap, py::arg("pages"), py::arg("synchronize") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("tensors", &PageGroup::tensors);

  py::class_<PageMapper>(m, "PageMapper")
      .def(py::init<const std::string&, int, std::size_t>(), py::arg("backend"),
           py::arg("device"), py::arg("page_size"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &PageMapper::backend_name)
      .def_property_readonly("device", &PageMapper::device)
      .def_property_readonly("dlpack_device_type", &PageMapper::dlpack_device_type)
      .def_property_readonly("page_size", &PageMapper::page_size)
      .def_property_readonly("granularity", &PageMapper::granularity)
      .def("reserve", &PageMapper::reserve, py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("map", &PageMapper::map, py::arg("tensors"), py::arg("pages"),
           py::call_guard<py::gil_scoped_release>())
      .def("unmap", &PageMapper::unmap, py::arg("tensors"), py::arg("pages"),
           py::arg("synchronize") = true, py::call_guard<py::gil_scoped_release>())
      .def("group", &PageMapper::group, py::arg("tensors"),
           "A PageGroup over `tensors` (checked once): page p of each maps together.")
      .def("trim_pool", &PageMapper::trim_pool, py::arg("keep") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("set_pool_limit", &PageMapper::set_pool_limit, py::arg("limit"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", &PageMapper::stats)
      .def(
          "mem_info",
          [](const PageMapper& self) {
            MemInfo mi;
            {
              py::gil_scoped_release release;
              mi = self.mem_info();
            }
            return py::make_tuple(mi.free_bytes, mi.total_bytes);
          },
          "(free, total) bytes of the device.")
      .def("synchronize", &PageMapper::synchronize,
           py::call_guard<py::gil_scoped_release>());

  py::class_<PageServer, std::shared_ptr<PageServer>>(
      m, "PageServer",
      "Applies map / unmap / query requests of KV groups to a page mapper, and answers "
      "them on an IPC socket without the GIL (csrc/page_server.h).")
      .def(py::init<PageMapper, std::size_t>(), py::arg("mapper"), py::arg("pool_keep"))
      .def(
          "add_group",
          [](PageServer& self, std::uint32_t group,
             const std::vector<std::pair<std::shared_ptr<VirtualTensor>,
                                         std::vector<std::int64_t>>>& tensors,
             std::size_t num_pages) {
            std::vector<ServedTensor> served;
            for (const auto& t : tensors) served.push_back(ServedTensor{t.first, t.second});
            self.add_group(group, std::move(served), num_pages);
          },
          py::arg("group"), py::arg("tensors"), py::arg("num_pages"),
          "Group `group`: page p is page base + p of each (tensor, bases) entry.")
      .def("has_group", &PageServer::has_group, py::arg("group"))
      .def(
          "apply",
          [](PageServer& self, const std::string& op, std::uint32_t group,
             const std::vector<std::int64_t>& pages) {
            PageOp code;
            if (op == "map") {
              code = PageOp::kMap;
            } else if (op == "unmap") {
              code = PageOp::kUnmap;
            } else if (op == "query") {
              code = PageOp::kQuery;
            } else if (op == "meminfo") {
              code = PageOp::kMemInfo;
            } else {
              throw py::value_error("unknown operation '" + op + "'");
            }
            py::gil_scoped_release release;
            return self.apply(code, group, pages);
          },
          py::arg("op"), py::arg("group"), py::arg("pages"),
          "'map', 'unmap' or 'query' pages of a group (query returns the mapped ones), or "
          "'meminfo': [free bytes, total bytes, pooled handles] of the device.")
      .def(
          "serve",
          [](PageServer& self, int fd) {
            std::string frame;
            {
              py::gil_scoped_release release;
              frame = self.serve(fd);
            }
            return py::bytes(frame);
          },
          py::arg("fd"),
          "Answers page requests on socket `fd`; returns the first frame left to the "
          "caller, or b'' once the peer closed.")
      .def_property_readonly("served", &PageServer::served);

  if (!add_block_table_type(m.ptr())) throw py::error_already_set();

  m.def(
      "time_raw_driver_calls",
      [](const std::string& backend, int device, std::size_t page_size,
         std::size_t pages) {
        RawTimings t;
        {
          py::gil_scoped_release release;
          t = time_raw_driver_calls(backend, device, page_size, pages);
        }
        py::dict out;
        out["reserve_us"] = t.reserve_us;
        out["create_us"] = t.create_us;
        out["map_us"] = t.map_us;
        out["set_access_us"] = t.set_access_us;
        out["unmap_us"] = t.unmap_us;
        out["release_us"] = t.release_us;
        return out;
      },
      py::arg("backend"), py::arg("device"), py::arg("page_size"), py::arg("pages"),
      "Per-call microseconds of the backend's raw VMM calls (benchmark baseline).");

  m.def(
      "time_mapper_calls",
      [](PageMapper& mapper, std::size_t pages) {
        MapperTimings t;
        {
          py::gil_scoped_release release;
          t = time_mapper_calls(mapper, pages);
        }
        py::dict out;
        out["cold_map_us"] = t.cold_map_us;
        out["unmap_us"] = t.unmap_us;
        out["recycled_map_us"] = t.recycled_map_us;
        out["unmap_release_us"] = t.unmap_release_us;
        return out;
      },
      py::arg("mapper"), py::arg("pages"),
      "Per-call microseconds of the page mapper's own map/unmap, timed in C++.");

  m.def(
      "_arm_faults",
      [](const std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t, std::string,
                                      double>>& rules) {
        std::vector<faults::Rule> out;
        for (const auto& [site, first, last, action, seconds] : rules) {
          faults::Rule r{};
          if (site == "map") r.site = faults::Site::kMap;
          else if (site == "create") r.site = faults::Site::kCreate;
          else if (site == "ipc") r.site = faults::Site::kIpc;
          else throw py::value_error("unknown native fault site " + site);
          if (action == "fail") r.action = faults::Action::kFail;
          else if (action == "stall") r.action = faults::Action::kStall;
          else if (action == "kill") r.action = faults::Action::kKill;
          else throw py::value_error("unknown fault action " + action);
          r.first = first;
          r.last = last;
          r.seconds = seconds;
          out.push_back(r);
        }
        faults::arm(std::move(out));
      },
      py::arg("rules"),
      "Arm native fault rules (site, first, last, action, seconds); [] disarms. "
      "Use kvcached_core.faults.configure().");
  m.def("_fault_counts", []() {
    py::dict out;
    const auto c = faults::counts();
    for (int i = 0; i < faults::kNumSites; ++i)
      out[faults::site_name(static_cast<faults::Site>(i))] = c[i];
    return out;
  }, "Calls counted at each native fault site since the rules were armed.");
  m.def("_faults_armed", []() { return faults::g_armed.load(); });
  // KVCACHED_FAULTS is read once, here, when the module loads.
  py::module_::import("kvcached_core.faults").attr("_arm_native")(m);
}
