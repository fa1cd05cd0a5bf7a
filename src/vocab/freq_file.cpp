#include "vocab/freq_file.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <numeric>

#include "util/error.h"

namespace microspec {

namespace {

constexpr char kMagic[8] = {'M', 'S', 'P', 'F', 'R', 'E', 'Q', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 32;

template <class T>
void put(std::string& out, T v) {
  // The project targets x86-64 (little-endian), so the in-memory bytes are the file's bytes.
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <class T>
T get(const std::string& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}

}  // namespace

TokenFrequencies TokenFrequencies::from_counts(const std::vector<uint64_t>& count_of_id) {
  if (count_of_id.empty() || count_of_id.size() > size_t(INT32_MAX))
    throw Error("token counts: bad vocabulary size");
  TokenFrequencies f;
  f.n_vocab = static_cast<int32_t>(count_of_id.size());
  f.ids.resize(count_of_id.size());
  std::iota(f.ids.begin(), f.ids.end(), 0);
  std::stable_sort(f.ids.begin(), f.ids.end(),
                   [&](int32_t a, int32_t b) { return count_of_id[a] > count_of_id[b]; });
  f.counts.resize(f.ids.size());
  for (size_t i = 0; i < f.ids.size(); ++i) {
    f.counts[i] = count_of_id[f.ids[i]];
    f.total += f.counts[i];
  }
  return f;
}

std::vector<int32_t> TokenFrequencies::top(int32_t k) const {
  const size_t n = std::min(ids.size(), size_t(std::max(k, 0)));
  return std::vector<int32_t>(ids.begin(), ids.begin() + n);
}

void write_freq_file(const std::string& path, const TokenFrequencies& f) {
  if (f.ids.size() != f.counts.size() || f.ids.empty() || f.n_vocab <= 0 || f.ids.size() > size_t(f.n_vocab))
    throw Error("frequency file " + path + ": inconsistent table");
  std::string out;
  out.reserve(kHeaderBytes + 12 * f.ids.size());
  out.append(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kVersion);
  put<uint32_t>(out, uint32_t(f.n_vocab));
  put<uint32_t>(out, uint32_t(f.ids.size()));
  put<uint32_t>(out, 0);
  put<uint64_t>(out, f.total);
  for (int32_t id : f.ids) put<int32_t>(out, id);
  for (uint64_t c : f.counts) put<uint64_t>(out, c);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) throw Error("frequency file " + path + ": cannot open for writing");
  file.write(out.data(), std::streamsize(out.size()));
  file.close();
  if (!file) throw Error("frequency file " + path + ": write failed");
}

TokenFrequencies read_freq_file(const std::string& path, int32_t expected_vocab) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw Error("frequency file " + path + ": cannot open");
  const std::string in((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const std::string where = "frequency file " + path + ": ";
  if (in.size() < kHeaderBytes)
    throw Error(where + "truncated header (" + std::to_string(in.size()) +
                " bytes; not written by vocab-freq?)");
  if (std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0)
    throw Error(where + "bad magic (not a file written by `microspec vocab-freq`)");
  const uint32_t version = get<uint32_t>(in, 8);
  if (version != kVersion)
    throw Error(where + "version " + std::to_string(version) + " is not supported (this build reads " +
                std::to_string(kVersion) + ")");
  const uint32_t n_vocab = get<uint32_t>(in, 12), n = get<uint32_t>(in, 16);
  if (get<uint32_t>(in, 20) != 0) throw Error(where + "reserved header field is not 0");
  if (n_vocab == 0 || n_vocab > uint32_t(INT32_MAX))
    throw Error(where + "bad vocabulary size " + std::to_string(n_vocab));
  if (n == 0 || n > n_vocab)
    throw Error(where + "holds " + std::to_string(n) + " ids for a vocabulary of " + std::to_string(n_vocab));
  const uint64_t want = kHeaderBytes + 12ull * n;
  if (in.size() != want)
    throw Error(where + (in.size() < want ? "truncated" : "trailing bytes") + " (" +
                std::to_string(in.size()) + " bytes, expected " + std::to_string(want) + ")");
  if (expected_vocab > 0 && n_vocab != uint32_t(expected_vocab))
    throw Error(where + "counted with a vocabulary of " + std::to_string(n_vocab) +
                " tokens, but the model has " + std::to_string(expected_vocab) +
                " (made for another model?)");
  TokenFrequencies f;
  f.n_vocab = int32_t(n_vocab);
  f.total = get<uint64_t>(in, 24);
  f.ids.resize(n);
  f.counts.resize(n);
  std::memcpy(f.ids.data(), in.data() + kHeaderBytes, 4ull * n);
  std::memcpy(f.counts.data(), in.data() + kHeaderBytes + 4ull * n, 8ull * n);
  std::vector<uint8_t> seen(n_vocab, 0);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t id = f.ids[i];
    if (id < 0 || uint32_t(id) >= n_vocab)
      throw Error(where + "id " + std::to_string(id) + " at rank " + std::to_string(i) +
                  " is outside the vocabulary");
    if (seen[id]) throw Error(where + "id " + std::to_string(id) + " appears twice");
    seen[id] = 1;
    if (i > 0 && f.counts[i] > f.counts[i - 1])
      throw Error(where + "counts are not ranked (rank " + std::to_string(i) + ")");
    sum += f.counts[i];
  }
  if (sum != f.total)
    throw Error(where + "counts sum to " + std::to_string(sum) + ", header says " + std::to_string(f.total));
  return f;
}

}  // namespace microspec
