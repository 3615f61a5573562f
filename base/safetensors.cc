#include "base/safetensors.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/atomic_file.h"

namespace vlmgraph {
namespace {

using nlohmann::json;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

at::ScalarType ParseDtype(const std::string& s, const std::string& path, const std::string& name) {
  for (const auto& d : kDtypes) {
    if (s == d.name) return d.type;
  }
  throw SafetensorsError(path + ": tensor '" + name + "' has unsupported dtype '" + s + "'");
}

const char* DtypeToName(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (t == d.type) return d.name;
  }
  throw SafetensorsError(std::string("cannot write dtype ") + c10::toString(t) + " to safetensors");
}

// The list of integers `entry[key]`; get<> alone would convert a float such as 1e300 to an
// integer, which is undefined behaviour.
template <typename T>
std::vector<T> Integers(const json& entry, const char* key, const std::string& path,
                        const std::string& name) {
  const json& list = entry.at(key);
  if (!list.is_array() ||
      !std::all_of(list.begin(), list.end(), [](const json& v) { return v.is_number_integer(); })) {
    throw SafetensorsError(path + ": tensor '" + name + "' has a " + key +
                           " that is not a list of integers");
  }
  return list.get<std::vector<T>>();
}

}  // namespace

SafetensorsFile ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SafetensorsError("cannot open '" + path + "'");
  in.seekg(0, std::ios::end);
  const uint64_t file_bytes = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint8_t len_bytes[8];
  if (file_bytes < 8 || !in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    throw SafetensorsError(path + ": file too short for a safetensors header");
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  if (header_bytes > file_bytes - 8 || header_bytes > (100u << 20)) {
    throw SafetensorsError(path + ": header length " + std::to_string(header_bytes) +
                           " exceeds the file size; not a safetensors file?");
  }
  std::string header(header_bytes, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_bytes));
  json j;
  try {
    j = json::parse(header);
  } catch (const json::exception& e) {
    throw SafetensorsError(path + ": header is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw SafetensorsError(path + ": header is not a JSON object");
  const uint64_t data_begin = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_begin;

  SafetensorsFile out;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.items()) {
        out.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
      }
      continue;
    }
    try {
      const auto type = ParseDtype(entry.at("dtype").get<std::string>(), path, name);
      std::vector<int64_t> shape = Integers<int64_t>(entry, "shape", path, name);
      auto offsets = Integers<uint64_t>(entry, "data_offsets", path, name);
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_bytes) {
        throw SafetensorsError(path + ": tensor '" + name + "' has data_offsets outside the file");
      }
      // The size the shape needs, checked against the stored bytes before anything is allocated
      // (a header may declare any shape: negative, or with a product past 2^64).
      const uint64_t stored = offsets[1] - offsets[0];
      uint64_t want = c10::elementSize(type);
      for (const int64_t d : shape) {
        if (d < 0) {
          throw SafetensorsError(path + ": tensor '" + name + "' has a negative dimension " +
                                 std::to_string(d));
        }
        want = d == 0 || want <= stored / static_cast<uint64_t>(d) ? want * d : stored + 1;
      }
      if (want != stored) {
        throw SafetensorsError(path + ": tensor '" + name + "' holds " + std::to_string(stored) +
                               " bytes but its shape and dtype need " +
                               (want > stored ? "more" : std::to_string(want)));
      }
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
      in.seekg(static_cast<std::streamoff>(data_begin + offsets[0]));
      if (want > 0 &&
          !in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(want))) {
        throw SafetensorsError(path + ": short read for tensor '" + name + "'");
      }
      out.tensors.emplace(name, std::move(t));
    } catch (const json::exception& e) {
      throw SafetensorsError(path + ": malformed header entry for '" + name + "': " + e.what());
    }
  }
  return out;
}

void WriteSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  data.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t n = static_cast<uint64_t>(t.nbytes());
    header[name] = {{"dtype", DtypeToName(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(std::move(t));
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  // A fresh temporary renamed into place (base/atomic_file.h): never written through a symbolic
  // link planted in the directory, and removed when a write fails.
  AtomicFile out(path);
  const uint64_t len = h.size();
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(len >> (8 * i));
  out.Write(len_bytes, 8);
  out.Write(h.data(), h.size());
  for (const auto& t : data) out.Write(t.data_ptr(), t.nbytes());
  out.Commit();
}

}  // namespace vlmgraph
