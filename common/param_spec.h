// ParamSpec: a tensor's Hugging Face name and shape — what the model declares
// (engine/model) and the parameter registry flattens into sub-groups (engine/memory), kept here so
// neither depends on the other. A plain value type.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zo {

struct ParamSpec {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;  // every dimension ≥ 1
  // false: a frozen param, fetched for the forward but never updated; it has no optimizer state and
  // no gradient (Note [Frozen sub-groups] in engine/memory/param_registry.cpp).
  bool trainable = true;
  // A frozen weight of a 4-bit or 8-bit base kept packed (Note [The packed 4-bit base] in
  // common/bnb4_blob.h): its compute copy is a blob of bnb4::blob_bytes(type, rows, cols) bytes,
  // `storage_elems` elements of the compute dtype, instead of one element per weight. 0: not packed.
  uint64_t storage_elems = 0;
  bool packed() const { return storage_elems != 0; }
};

}  // namespace zo
