#include "checkpoint/pytorch_checkpoint.h"

#include "checkpoint/pickle.h"
#include "checkpoint/zip_reader.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace microspec {

namespace {

// The first bytes of a legacy torch.save file: a pickle (protocol 2) of its magic number.
bool looks_like_legacy_torch(const uint8_t* data, size_t size) { return size >= 2 && data[0] == 0x80 && data[1] <= 5; }

std::string shape_text(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

std::unique_ptr<PytorchCheckpoint> PytorchCheckpoint::open(const std::string& path) {
  std::unique_ptr<PytorchCheckpoint> c(new PytorchCheckpoint());
  c->name_ = path;
  c->mapping_ = std::make_unique<MappedFile>(path, "PyTorch checkpoint");
  c->parse(c->mapping_->data(), c->mapping_->size());
  return c;
}

std::unique_ptr<PytorchCheckpoint> PytorchCheckpoint::from_memory(const uint8_t* data, size_t size, std::string name) {
  std::unique_ptr<PytorchCheckpoint> c(new PytorchCheckpoint());
  c->name_ = std::move(name);
  c->parse(data, size);
  return c;
}

PytorchCheckpoint::~PytorchCheckpoint() = default;

const CheckpointTensor* PytorchCheckpoint::find(std::string_view tensor_name) const {
  for (const CheckpointTensor& t : tensors_)
    if (t.name == tensor_name) return &t;
  return nullptr;
}

void PytorchCheckpoint::parse(const uint8_t* data, size_t size) {
  auto fail = [&](const std::string& what) { throw Error(name_ + ": " + what); };
  if (!ZipArchive::looks_like_zip(data, size)) {
    if (looks_like_legacy_torch(data, size))
      fail("legacy (pre-1.6, non-zip) torch.save format, not supported: re-save it with a current PyTorch "
           "(torch.save(torch.load(f), f)) or convert it to safetensors");
    fail("not a PyTorch checkpoint (expected the zip archive torch.save writes)");
  }
  const ZipArchive zip(data, size, name_);

  // The archive's folder: the one holding data.pkl.
  std::string prefix;
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : zip.entries()) {
    const size_t slash = e.name.find('/');
    if (slash != std::string::npos && e.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (pkl) fail("two data.pkl entries ('" + pkl->name + "', '" + e.name + "')");
      pkl = &e;
      prefix = e.name.substr(0, slash + 1);
    }
  }
  if (!pkl) {
    if (zip.find(prefix + "constants.pkl") || !zip.entries().empty())
      fail("no <archive>/data.pkl entry: not a torch.save state dict (a TorchScript archive or another zip?)");
    fail("empty zip archive");
  }
  if (!ZipArchive::crc_ok(*pkl)) fail("'" + pkl->name + "' fails its CRC-32 check (corrupt file)");
  if (const ZipEntry* order = zip.find(prefix + "byteorder")) {
    const std::string v(order->data.begin(), order->data.end());
    if (v != "little") fail("byte order '" + v + "' is not supported (little-endian only)");
  }

  const PickledStateDict sd = unpickle_state_dict(pkl->data, name_ + " (" + pkl->name + ")");

  // Storages: one archive entry each, exactly the declared size.
  std::vector<std::span<const uint8_t>> storage_bytes;
  for (const PickledStorage& s : sd.storages) {
    const std::string entry = prefix + "data/" + s.key;
    const ZipEntry* e = zip.find(entry);
    if (!e) fail("storage entry '" + entry + "' is missing");
    const uint64_t need = uint64_t(s.numel) * dtype_bytes(s.dtype);
    if (e->data.size() != need)
      fail("storage '" + entry + "' holds " + std::to_string(e->data.size()) + " bytes, its " + dtype_name(s.dtype) +
           " x " + std::to_string(s.numel) + " elements need " + std::to_string(need));
    storage_bytes.push_back(e->data);
  }

  // Tensors: contiguous views inside their storage.
  for (const PickledTensor& p : sd.tensors) {
    const PickledStorage& s = sd.storages[p.storage];
    CheckpointTensor t;
    t.name = p.name;
    t.dtype = s.dtype;
    t.shape = p.shape;
    const std::string where = "tensor '" + p.name + "' " + shape_text(p.shape) + ": ";
    int64_t n = 1, expect_stride = 1;
    for (size_t d = p.shape.size(); d-- > 0;) {
      const int64_t len = p.shape[d];
      if (len < 0 || len > (int64_t(1) << 40) || (len != 0 && n > (int64_t(1) << 48) / len))
        fail(where + "invalid size");
      if (len != 1 && p.strides[d] != expect_stride)
        fail(where + "is a non-contiguous view (stride " + shape_text(p.strides) +
             "): re-save the state dict with .contiguous() tensors");
      n *= len;
      expect_stride *= len;
    }
    if (p.offset < 0 || p.offset > s.numel || n > s.numel - p.offset)
      fail(where + std::to_string(n) + " elements at offset " + std::to_string(p.offset) + " run past storage '" +
           s.key + "' of " + std::to_string(s.numel) + " elements");
    const size_t es = dtype_bytes(s.dtype);
    t.data = storage_bytes[p.storage].subspan(size_t(p.offset) * es, size_t(n) * es);
    tensors_.push_back(std::move(t));
  }
}

}  // namespace microspec
