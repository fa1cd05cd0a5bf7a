#pragma once
// A restricted unpickler for the data.pkl of a torch.save'd state dict: a pickle machine that
// implements only the opcodes torch.save emits (protocol 2, plus the framing and short forms of
// protocols 3-5) and resolves only the globals a state dict needs:
//   collections.OrderedDict                       the dict (and the empty backward-hooks dict)
//   torch._utils._rebuild_tensor_v2               (storage, offset, size, stride, requires_grad,
//                                                  hooks[, metadata]) -> a tensor view
//   torch._utils._rebuild_parameter               (tensor, requires_grad, hooks) -> the tensor
//   torch.{Float,Double,Half,BFloat16,Long,Int,Short,Char,Byte,Bool}Storage
//                                                  storage types inside the persistent id
//                                                  ('storage', TYPE, key, location, numel)
// Nothing is ever called or imported: a global is a name looked up in that table, REDUCE applies
// one of the three functions above to data, and any other global (os.system, builtins.eval,
// posix.*, subprocess ...) or opcode (INST, OBJ, NEWOBJ, EXT*) is refused with an Error naming it
// the moment it is read. Values live in one arena indexed by number, so shared references (memo)
// and even cycles cost nothing and free nothing twice; memory is bounded by the pickle's size.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace microspec {

struct PickledStorage {
  std::string key;  // the archive entry data/<key>
  TensorDtype dtype = TensorDtype::F32;
  int64_t numel = 0;  // elements the persistent id declares
};

struct PickledTensor {
  std::string name;  // the state dict's key
  size_t storage = 0;  // index into PickledStateDict::storages
  int64_t offset = 0;  // storage offset, in elements
  std::vector<int64_t> shape, strides;  // strides in elements
};

struct PickledStateDict {
  std::vector<PickledStorage> storages;  // one per distinct key, first-use order
  std::vector<PickledTensor> tensors;    // the dict's order
};

// Runs the restricted machine over `pickle`; the result must be a dict of string keys to tensors.
// Throws Error("WHERE: ...") naming the refused global or opcode, or what is malformed.
PickledStateDict unpickle_state_dict(std::span<const uint8_t> pickle, const std::string& where);

}  // namespace microspec
