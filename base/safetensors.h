// base/safetensors.h: reading and writing the safetensors format that nanoVLM checkpoints use.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// then N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the byte after the header) plus an optional "__metadata__" object of
// string -> string, then the raw little-endian tensor data.
//
//   vlmgraph::SafetensorsFile f = vlmgraph::ReadSafetensors("model.safetensors");
//   at::Tensor w = f.tensors.at("MP.proj.weight");          // CPU tensor, dtype as stored
//   vlmgraph::WriteSafetensors("out.safetensors", f.tensors, f.metadata);
//
// Supported dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL. Errors: throws
// `SafetensorsError` naming the file and what is malformed; std::system_error for failed writes. Thread rules: free functions, no state.
#pragma once

#include <ATen/Tensor.h>

#include <map>
#include <stdexcept>
#include <string>

namespace vlmgraph {

class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;    // name -> contiguous CPU tensor
  std::map<std::string, std::string> metadata;  // the "__metadata__" object, if any
};

// Reads every tensor into CPU memory (one read per tensor, no second copy of the file).
SafetensorsFile ReadSafetensors(const std::string& path);

// Writes `tensors` (any device, any layout: copied to contiguous CPU) with `metadata`. The header
// is padded with spaces to a multiple of 8 bytes, as the reference implementation does. Writes a
// fresh `path + ".tmp"` and renames it (base/atomic_file.h), so a crash never leaves a truncated
// checkpoint behind, a failed write leaves no temporary, and a symbolic link at either name is
// replaced, never written through. Throws std::system_error when a write fails (e.g. disk full).
void WriteSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace vlmgraph
