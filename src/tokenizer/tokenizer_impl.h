#pragma once
// Internals shared by the SentencePiece-style and byte-level BPE tokenizers: the string index,
// the special-token splitter and the common loader. Not part of the public interface.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace microspec {

class GgufFile;

namespace tok {

inline uint64_t hash_bytes(std::string_view s) {
  return std::hash<std::string_view>{}(s);
}

// Open-addressing (linear probing) index from strings to entry numbers. Slots hold
// (hash32 << 32) | (entry + 1); the strings themselves stay with the caller, who passes the
// same key function to build and find. The first entry wins when two keys are equal.
template <class KeyFn>
void index_build(std::vector<uint64_t>& slots, size_t n, KeyFn key) {
  size_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  slots.assign(cap, 0);
  const uint64_t mask = cap - 1;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view k = key(i);
    const uint64_t h = hash_bytes(k);
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (uint64_t pos = h & mask;; pos = (pos + 1) & mask) {
      const uint64_t v = slots[pos];
      if (v == 0) {
        slots[pos] = (static_cast<uint64_t>(tag) << 32) | (i + 1);
        break;
      }
      if (static_cast<uint32_t>(v >> 32) == tag && key(static_cast<uint32_t>(v) - 1) == k) break;
    }
  }
}

template <class KeyFn>
int32_t index_find(const std::vector<uint64_t>& slots, std::string_view s, KeyFn key) {
  if (slots.empty()) return -1;
  const uint64_t mask = slots.size() - 1;
  const uint64_t h = hash_bytes(s);
  const uint32_t tag = static_cast<uint32_t>(h >> 32);
  for (uint64_t pos = h & mask;; pos = (pos + 1) & mask) {
    const uint64_t v = slots[pos];
    if (v == 0) return -1;
    if (static_cast<uint32_t>(v >> 32) == tag) {
      const auto id = static_cast<int32_t>(static_cast<uint32_t>(v) - 1);
      if (key(id) == s) return id;
    }
  }
}

// A piece of input text after special-token splitting: a special token (token >= 0) or a run
// of raw text [offset, offset + length).
// Thread-local scratch that grows with the text is given back after a long text, so a long-lived
// thread (a server worker) that once tokenized a large prompt does not keep that much memory.
constexpr size_t kScratchKeepBytes = 256 * 1024;
template <class C>
void trim_scratch(C& c) {
  if (c.capacity() * sizeof(typename C::value_type) > kScratchKeepBytes) C().swap(c);
}

struct Fragment {
  int32_t token;
  size_t offset, length;
};

// Finds special-token strings in text the way llama.cpp does: tokens are tried longest first
// (ties by id), each taking its leftmost non-overlapping occurrences in the text that earlier
// tokens left free. A trie pass first finds which tokens occur at all, so only those are searched.
class SpecialSplitter {
 public:
  // candidates: ids of control, user-defined and unknown tokens.
  void build(const std::vector<std::string>& tokens, const std::vector<TokenType>& types);
  // Control and unknown tokens are matched only when parse_special; user-defined ones always.
  void split(std::string_view text, bool parse_special, std::vector<Fragment>& out) const;

 private:
  struct Node {
    int32_t first_child = -1, next_sibling = -1;
    int32_t entry = -1;  // index into entries_ of the token ending here, or -1
    uint8_t byte = 0;
  };
  struct Entry {
    int32_t token;
    uint32_t length;
    uint32_t rank;  // position in the longest-first order
    bool needs_parse_special;
  };
  std::vector<Node> nodes_;                // [n_nodes] trie; node 0 is the root
  std::array<int32_t, 256> root_child_{};  // [256] first-level node for each byte, or -1
  std::vector<Entry> entries_;             // [n special tokens]
  std::vector<std::string> texts_;         // [n special tokens] their strings
};

// State and loading shared by both tokenizer kinds; subclasses encode raw text fragments and
// print tokens.
class VocabTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const final;
  std::vector<int32_t> encode_with_literals(std::string_view text, bool add_bos,
                                            std::span<const TextRange> literal) const final;

 protected:
  struct Defaults {
    int32_t bos = -1, eos = -1, unk = -1;
    bool add_bos = false;
  };
  // Reads tokens, types, special ids, add_bos and builds the index, EOG set and splitter.
  void load_common(const GgufFile& file, const Defaults& defaults);
  // Encodes one run of raw text. after_special: the run starts the text or follows a special token.
  virtual void encode_fragment(std::string_view text, bool after_special,
                               std::vector<int32_t>& out) const = 0;
  void check_id(int32_t id) const;
  std::vector<int32_t> encode_impl(std::string_view text, bool add_bos, bool parse_special,
                                   std::span<const TextRange> literal) const;

  std::string file_name_;
  int32_t unk_id_ = -1;
  SpecialSplitter splitter_;
};

std::unique_ptr<Tokenizer> make_spm_tokenizer(const GgufFile& file);
std::unique_ptr<Tokenizer> make_bpe_tokenizer(const GgufFile& file);

// --- Pair merging shared by the SentencePiece and BPE tokenizers ------------------------------
// A symbol is a byte range of the text being merged, linked to its neighbours; length 0 once it
// has been merged into its left neighbour.
struct MergeSymbol {
  int32_t prev, next;
  uint32_t offset, length;
};

struct MergePair {
  double priority;  // larger merges first
  int32_t left, right;
  uint32_t size;  // combined length when queued; a mismatch later means the entry is stale
};

// The byte a "<0xXX>" byte token stands for (the hex digits parsed as far as they are hex, like strtol).
std::string byte_token_bytes(std::string_view text);

// One symbol per UTF-8 character of text (a truncated sequence at the end stays one symbol).
void split_utf8_symbols(std::string_view text, std::vector<MergeSymbol>& syms);

// Repeatedly merges the adjacent pair with the highest priority (the leftmost on ties) until no
// pair has one. priority(left, right, &p) returns false when the two symbols cannot merge.
template <class Priority>
void merge_pairs(std::vector<MergeSymbol>& syms, std::vector<MergePair>& heap, Priority&& priority) {
  // Max-heap order: higher priority first, then the leftmost pair.
  auto less = [](const MergePair& a, const MergePair& b) {
    return a.priority < b.priority || (a.priority == b.priority && a.left > b.left);
  };
  heap.clear();
  auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    double p;
    if (!priority(syms[left], syms[right], &p)) return;
    heap.push_back(MergePair{p, left, right, syms[left].length + syms[right].length});
    std::push_heap(heap.begin(), heap.end(), less);
  };
  for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i) try_add(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), less);
    const MergePair b = heap.back();
    heap.pop_back();
    MergeSymbol& left = syms[b.left];
    MergeSymbol& right = syms[b.right];
    if (left.length == 0 || right.length == 0 || left.length + right.length != b.size) continue;
    left.length += right.length;
    right.length = 0;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = b.left;
    try_add(left.prev, b.left);
    try_add(b.left, left.next);
  }
}

}  // namespace tok
}  // namespace microspec
