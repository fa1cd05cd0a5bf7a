#include "checkpoint/pickle.h"

#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "util/error.h"

namespace microspec {

namespace {

constexpr size_t kMaxPickleBytes = size_t(64) << 20;  // a state dict's pickle is ~100 bytes per tensor
constexpr size_t kMaxGlobalLine = 256;
constexpr size_t kMaxDims = 8;

// The globals a state dict needs; everything else is refused by name.
enum class Callable { None, OrderedDict, RebuildTensor, RebuildParameter };
struct AllowedGlobal {
  const char* module;
  const char* name;
  Callable callable;    // what REDUCE may apply (None: a storage type, never called)
  TensorDtype dtype;    // storage types only
};
constexpr AllowedGlobal kAllowed[] = {
    {"collections", "OrderedDict", Callable::OrderedDict, TensorDtype::F32},
    {"torch._utils", "_rebuild_tensor_v2", Callable::RebuildTensor, TensorDtype::F32},
    {"torch._utils", "_rebuild_parameter", Callable::RebuildParameter, TensorDtype::F32},
    {"torch", "FloatStorage", Callable::None, TensorDtype::F32},
    {"torch", "DoubleStorage", Callable::None, TensorDtype::F64},
    {"torch", "HalfStorage", Callable::None, TensorDtype::F16},
    {"torch", "BFloat16Storage", Callable::None, TensorDtype::BF16},
    {"torch", "LongStorage", Callable::None, TensorDtype::I64},
    {"torch", "IntStorage", Callable::None, TensorDtype::I32},
    {"torch", "ShortStorage", Callable::None, TensorDtype::I16},
    {"torch", "CharStorage", Callable::None, TensorDtype::I8},
    {"torch", "ByteStorage", Callable::None, TensorDtype::U8},
    {"torch", "BoolStorage", Callable::None, TensorDtype::Bool},
};

std::string allowed_list() {
  std::string s;
  for (const AllowedGlobal& g : kAllowed) s += (s.empty() ? "" : ", ") + std::string(g.module) + "." + g.name;
  return s;
}

// Opcodes torch.save never emits, named in the refusal.
const char* refused_opcode_name(uint8_t op) {
  switch (op) {
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 0x82: case 0x83: case 0x84: return "EXT";
    case 'P': return "PERSID";
    case 'S': return "STRING";
    case 'V': return "UNICODE";
    case 'F': return "FLOAT";
    case 'I': return "INT";
    case 'L': return "LONG";
    case 'g': return "GET";
    case 'p': return "PUT";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    default: return nullptr;
  }
}

enum class Kind : uint8_t { None, Bool, Int, Float, Str, Tuple, List, Dict, Global, Storage, Tensor };

const char* kind_name(Kind k) {
  static const char* names[] = {"None", "bool", "int", "float", "str", "tuple", "list", "dict", "global", "storage", "tensor"};
  return names[static_cast<int>(k)];
}

struct Value {
  Kind kind = Kind::None;
  int64_t i = 0;                // Bool, Int; Global: index into kAllowed; Storage / Tensor: index
  double f = 0.0;               // Float
  std::string s;                // Str (bytes too)
  std::vector<uint32_t> items;  // Tuple, List: elements; Dict: key, value, key, value ...
};

class Machine {
 public:
  Machine(std::span<const uint8_t> in, const std::string& where) : in_(in), where_(where) {}

  PickledStateDict run() {
    if (in_.size() > kMaxPickleBytes)
      fail("pickle of " + std::to_string(in_.size()) + " bytes exceeds the 64 MB a state dict needs");
    while (true) {
      const size_t at = pos_;
      const uint8_t op = byte();
      if (step(op, at)) break;
    }
    if (stack_.size() != 1) fail("the pickle leaves " + std::to_string(stack_.size()) + " values, expected 1");
    return state_dict(stack_[0]);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw Error(where_ + ": " + what); }

  // Input.
  std::span<const uint8_t> take(uint64_t n) {
    if (n > in_.size() - pos_) fail("pickle truncated at byte " + std::to_string(pos_) + " (" + std::to_string(n) +
                                    " bytes needed, " + std::to_string(in_.size() - pos_) + " left)");
    auto s = in_.subspan(pos_, size_t(n));
    pos_ += size_t(n);
    return s;
  }
  uint8_t byte() { return take(1)[0]; }
  uint64_t uint_le(int bytes) {
    auto s = take(uint64_t(bytes));
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | s[size_t(i)];
    return v;
  }
  std::string text(uint64_t n) {
    auto s = take(n);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  std::string line() {
    std::string s;
    while (true) {
      const uint8_t c = byte();
      if (c == '\n') return s;
      if (s.size() >= kMaxGlobalLine) fail("GLOBAL name longer than " + std::to_string(kMaxGlobalLine) + " bytes");
      s += char(c);
    }
  }

  // Values and the stack.
  uint32_t make(Value v) {
    values_.push_back(std::move(v));
    return static_cast<uint32_t>(values_.size() - 1);
  }
  uint32_t make_int(int64_t i, Kind k = Kind::Int) {
    Value v;
    v.kind = k;
    v.i = i;
    return make(std::move(v));
  }
  void push(uint32_t v) { stack_.push_back(v); }
  uint32_t pop() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("pickle pops an empty stack");
    const uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  uint32_t top() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("pickle reads an empty stack");
    return stack_.back();
  }
  std::vector<uint32_t> pop_mark() {
    if (marks_.empty()) fail("pickle has no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + std::ptrdiff_t(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Value& at(uint32_t v) { return values_[v]; }
  uint32_t tuple(std::vector<uint32_t> items) {
    Value v;
    v.kind = Kind::Tuple;
    v.items = std::move(items);
    return make(std::move(v));
  }
  Value& expect(uint32_t v, Kind k, const char* what) {
    if (at(v).kind != k) fail(std::string(what) + " is a " + kind_name(at(v).kind) + ", expected a " + kind_name(k));
    return at(v);
  }

  uint32_t global(const std::string& module, const std::string& name) {
    for (size_t i = 0; i < std::size(kAllowed); ++i)
      if (module == kAllowed[i].module && name == kAllowed[i].name) {
        Value v;
        v.kind = Kind::Global;
        v.i = int64_t(i);
        return make(std::move(v));
      }
    fail("the pickle names the global '" + module + "." + name +
         "', which a state dict never needs: refused, nothing was run (allowed: " + allowed_list() + ")");
  }

  // Runs one opcode; true at STOP.
  bool step(uint8_t op, size_t at_byte) {
    switch (op) {
      case 0x80: byte(); return false;             // PROTO
      case 0x95: uint_le(8); return false;         // FRAME: the length is not needed
      case '.': return true;                       // STOP
      case '(': marks_.push_back(stack_.size()); return false;  // MARK
      case '0': pop(); return false;               // POP
      case '1': pop_mark(); return false;          // POP_MARK
      case '2': push(top()); return false;         // DUP
      case 'N': push(make(Value{})); return false;  // NONE
      case 0x88: push(make_int(1, Kind::Bool)); return false;  // NEWTRUE
      case 0x89: push(make_int(0, Kind::Bool)); return false;  // NEWFALSE
      case 'J': push(make_int(int32_t(uint32_t(uint_le(4))))); return false;  // BININT
      case 'K': push(make_int(int64_t(uint_le(1)))); return false;            // BININT1
      case 'M': push(make_int(int64_t(uint_le(2)))); return false;            // BININT2
      case 0x8a: push(make_int(long_int(uint_le(1)))); return false;          // LONG1
      case 0x8b: push(make_int(long_int(uint_le(4)))); return false;          // LONG4
      case 'G': {                                                             // BINFLOAT (big endian)
        auto s = take(8);
        uint64_t bits = 0;
        for (uint8_t b : s) bits = (bits << 8) | b;
        Value v;
        v.kind = Kind::Float;
        std::memcpy(&v.f, &bits, 8);
        push(make(std::move(v)));
        return false;
      }
      case 'X': case 'B': case 'T': push(string_value(uint_le(4))); return false;  // BINUNICODE, BINBYTES, BINSTRING
      case 0x8c: case 'C': case 'U': push(string_value(uint_le(1))); return false;  // SHORT_BIN{UNICODE,BYTES,STRING}
      case 0x8d: case 0x8e: push(string_value(uint_le(8))); return false;           // BINUNICODE8, BINBYTES8
      case ')': push(tuple({})); return false;                                       // EMPTY_TUPLE
      case 't': push(tuple(pop_mark())); return false;                               // TUPLE
      case 0x85: case 0x86: case 0x87: {                                             // TUPLE1..3
        std::vector<uint32_t> items(size_t(op - 0x84));
        for (size_t i = items.size(); i-- > 0;) items[i] = pop();
        push(tuple(std::move(items)));
        return false;
      }
      case ']': case '}': {  // EMPTY_LIST, EMPTY_DICT
        Value v;
        v.kind = op == ']' ? Kind::List : Kind::Dict;
        push(make(std::move(v)));
        return false;
      }
      case 'l': case 'd': {  // LIST, DICT from the marked items
        Value v;
        v.kind = op == 'l' ? Kind::List : Kind::Dict;
        v.items = pop_mark();
        if (v.kind == Kind::Dict && v.items.size() % 2) fail("DICT with an odd number of items");
        push(make(std::move(v)));
        return false;
      }
      case 'a': {  // APPEND
        const uint32_t x = pop();
        expect(top(), Kind::List, "APPEND's target").items.push_back(x);
        return false;
      }
      case 'e': {  // APPENDS
        std::vector<uint32_t> xs = pop_mark();
        auto& list = expect(top(), Kind::List, "APPENDS' target").items;
        list.insert(list.end(), xs.begin(), xs.end());
        return false;
      }
      case 's': {  // SETITEM
        const uint32_t value = pop(), key = pop();
        auto& dict = expect(top(), Kind::Dict, "SETITEM's target").items;
        dict.push_back(key);
        dict.push_back(value);
        return false;
      }
      case 'u': {  // SETITEMS
        std::vector<uint32_t> kv = pop_mark();
        if (kv.size() % 2) fail("SETITEMS with an odd number of items");
        auto& dict = expect(top(), Kind::Dict, "SETITEMS' target").items;
        dict.insert(dict.end(), kv.begin(), kv.end());
        return false;
      }
      case 'h': push(memo_get(uint_le(1))); return false;   // BINGET
      case 'j': push(memo_get(uint_le(4))); return false;   // LONG_BINGET
      case 'q': memo_[uint32_t(uint_le(1))] = top(); return false;  // BINPUT
      case 'r': memo_[uint32_t(uint_le(4))] = top(); return false;  // LONG_BINPUT
      case 0x94: memo_[uint32_t(memo_.size())] = top(); return false;  // MEMOIZE
      case 'c': {  // GLOBAL module\nname\n
        const std::string module = line();
        push(global(module, line()));
        return false;
      }
      case 0x93: {  // STACK_GLOBAL
        const uint32_t name = pop(), module = pop();
        push(global(expect(module, Kind::Str, "STACK_GLOBAL's module").s, expect(name, Kind::Str, "STACK_GLOBAL's name").s));
        return false;
      }
      case 'Q': push(persistent_load(pop())); return false;  // BINPERSID
      case 'R': {                                             // REDUCE
        const uint32_t args = pop(), callable = pop();
        push(reduce(callable, args));
        return false;
      }
      case 'b': {  // BUILD: only an OrderedDict's attribute state (its _metadata), which is dropped
        const uint32_t state = pop();
        const Kind k = at(top()).kind;
        if (k != Kind::Dict) fail(std::string("BUILD on a ") + kind_name(k) + " (only a dict's attributes are allowed)");
        if (at(state).kind != Kind::Dict && at(state).kind != Kind::None && at(state).kind != Kind::Tuple)
          fail(std::string("BUILD with a ") + kind_name(at(state).kind) + " state");
        return false;
      }
      case 'i': {  // INST module\nname\n: name the global it would call
        const std::string module = line();
        global(module, line());
        [[fallthrough]];
      }
      default: {
        const char* name = refused_opcode_name(op);
        if (name)
          fail(std::string("pickle opcode ") + name + " at byte " + std::to_string(at_byte) +
               " is never emitted by torch.save: refused, nothing was run");
        fail("unknown pickle opcode 0x" + hex(op) + " at byte " + std::to_string(at_byte) + " (corrupt pickle?)");
      }
    }
  }

  static std::string hex(uint8_t b) {
    const char* d = "0123456789abcdef";
    return {d[b >> 4], d[b & 15]};
  }

  int64_t long_int(uint64_t n) {
    if (n > 8) fail("pickled integer of " + std::to_string(n) + " bytes does not fit 64 bits");
    auto s = take(n);
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) v = (v << 8) | s[i];
    if (n > 0 && n < 8 && (s[n - 1] & 0x80)) v |= ~uint64_t(0) << (8 * n);  // sign-extend
    return int64_t(v);
  }

  uint32_t string_value(uint64_t n) {
    Value v;
    v.kind = Kind::Str;
    v.s = text(n);
    return make(std::move(v));
  }

  uint32_t memo_get(uint64_t key) {
    auto it = memo_.find(uint32_t(key));
    if (it == memo_.end()) fail("pickle reads memo entry " + std::to_string(key) + ", which was never stored");
    return it->second;
  }

  int64_t int_of(uint32_t v, const char* what) {
    const Value& x = at(v);
    if (x.kind != Kind::Int && x.kind != Kind::Bool)
      fail(std::string(what) + " is a " + kind_name(x.kind) + ", expected an int");
    return x.i;
  }

  // ('storage', torch.XStorage, key, location, numel) -> a storage (one per key).
  uint32_t persistent_load(uint32_t pid) {
    const Value& t = expect(pid, Kind::Tuple, "persistent id");
    if (t.items.size() != 5 || at(t.items[0]).kind != Kind::Str || at(t.items[0]).s != "storage")
      fail("persistent id is not ('storage', type, key, location, numel)");
    const Value& type = expect(t.items[1], Kind::Global, "storage type");
    const AllowedGlobal& g = kAllowed[size_t(type.i)];
    if (g.callable != Callable::None)
      fail(std::string("storage type is ") + g.module + "." + g.name + ", not a torch storage type");
    const std::string key = expect(t.items[2], Kind::Str, "storage key").s;
    expect(t.items[3], Kind::Str, "storage location");
    const int64_t numel = int_of(t.items[4], "storage size");
    if (numel < 0 || numel > (int64_t(1) << 48)) fail("storage '" + key + "' declares " + std::to_string(numel) + " elements");
    size_t index = storages_.size();
    for (size_t i = 0; i < storages_.size(); ++i)
      if (storages_[i].key == key) index = i;
    if (index == storages_.size()) {
      storages_.push_back({key, g.dtype, numel});
    } else if (storages_[index].dtype != g.dtype || storages_[index].numel != numel) {
      fail("storage '" + key + "' is declared twice with different types or sizes");
    }
    return make_int(int64_t(index), Kind::Storage);
  }

  std::vector<int64_t> int_tuple(uint32_t v, const char* what) {
    const Value& t = at(v);
    if (t.kind != Kind::Tuple && t.kind != Kind::List)
      fail(std::string(what) + " is a " + kind_name(t.kind) + ", expected a tuple of ints");
    if (t.items.size() > kMaxDims) fail(std::string(what) + " has more than " + std::to_string(kMaxDims) + " dimensions");
    std::vector<int64_t> out;
    for (uint32_t x : t.items) out.push_back(int_of(x, what));
    return out;
  }

  uint32_t reduce(uint32_t callable, uint32_t args_v) {
    const Value& c = at(callable);
    if (c.kind != Kind::Global) fail(std::string("REDUCE calls a ") + kind_name(c.kind) + ", not an allowed function");
    const AllowedGlobal& g = kAllowed[size_t(c.i)];
    const std::vector<uint32_t> args = expect(args_v, Kind::Tuple, "REDUCE's arguments").items;
    switch (g.callable) {
      case Callable::OrderedDict: {
        if (!args.empty()) fail("collections.OrderedDict called with arguments");
        Value v;
        v.kind = Kind::Dict;
        return make(std::move(v));
      }
      case Callable::RebuildTensor: {
        if (args.size() != 6 && args.size() != 7)
          fail("torch._utils._rebuild_tensor_v2 takes 6 or 7 arguments, got " + std::to_string(args.size()));
        PickledTensor t;
        t.storage = size_t(expect(args[0], Kind::Storage, "a tensor's storage").i);
        t.offset = int_of(args[1], "a tensor's storage offset");
        t.shape = int_tuple(args[2], "a tensor's size");
        t.strides = int_tuple(args[3], "a tensor's stride");
        if (t.shape.size() != t.strides.size())
          fail("a tensor's size has " + std::to_string(t.shape.size()) + " dimensions, its stride " +
               std::to_string(t.strides.size()));
        tensors_.push_back(std::move(t));
        return make_int(int64_t(tensors_.size() - 1), Kind::Tensor);
      }
      case Callable::RebuildParameter:
        if (args.size() != 3) fail("torch._utils._rebuild_parameter takes 3 arguments, got " + std::to_string(args.size()));
        expect(args[0], Kind::Tensor, "a parameter's data");
        return args[0];
      case Callable::None:
        break;
    }
    fail(std::string("REDUCE calls ") + g.module + "." + g.name + ", which is not a function: refused");
  }

  PickledStateDict state_dict(uint32_t root) {
    const Value& d = at(root);
    if (d.kind != Kind::Dict) fail(std::string("the pickle holds a ") + kind_name(d.kind) + ", not a state dict");
    PickledStateDict out;
    out.storages = storages_;
    std::unordered_set<std::string> seen;
    for (size_t i = 0; i < d.items.size(); i += 2) {
      const std::string& key = expect(d.items[i], Kind::Str, "a state dict key").s;
      const Value& v = at(d.items[i + 1]);
      if (v.kind != Kind::Tensor) fail("state dict entry '" + key + "' is a " + kind_name(v.kind) + ", not a tensor");
      if (!seen.insert(key).second) fail("state dict key '" + key + "' appears twice");
      PickledTensor t = tensors_[size_t(v.i)];
      t.name = key;
      out.tensors.push_back(std::move(t));
    }
    return out;
  }

  std::span<const uint8_t> in_;
  const std::string& where_;
  size_t pos_ = 0;
  std::vector<Value> values_;          // the arena every stack and memo entry points into
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;          // stack heights at each open MARK
  std::unordered_map<uint32_t, uint32_t> memo_;
  std::vector<PickledStorage> storages_;
  std::vector<PickledTensor> tensors_;
};

}  // namespace

PickledStateDict unpickle_state_dict(std::span<const uint8_t> pickle, const std::string& where) {
  return Machine(pickle, where).run();
}

}  // namespace microspec
