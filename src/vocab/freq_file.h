#pragma once
// Token frequency files: token ids ranked by how often a tokenizer produced them over a corpus,
// written by `microspec vocab-freq` and read by the `freq` / `hybrid` draft vocabularies.
//
// Format, version 1 (all integers little-endian, no padding):
//   offset  size        field
//   0       8           magic "MSPFREQ\0"
//   8       4  u32      version = 1
//   12      4  u32      n_vocab: vocabulary size of the tokenizer that counted
//   16      4  u32      n: number of ranked ids that follow (1 <= n <= n_vocab)
//   20      4  u32      reserved, 0
//   24      8  u64      total: tokens counted over the corpus (= the sum of the counts)
//   32      4n i32      ids, most frequent first, distinct, each in [0, n_vocab)
//   32+4n   8n u64      counts, counts[i] belongs to ids[i], non-increasing
// The file is exactly 32 + 12n bytes. `vocab-freq` writes every id (n = n_vocab): ids it never saw
// come last with count 0, in id order, so any top-K is defined.
#include <cstdint>
#include <string>
#include <vector>

namespace microspec {

struct TokenFrequencies {
  int32_t n_vocab = 0;
  uint64_t total = 0;            // tokens counted
  std::vector<int32_t> ids;      // [n] most frequent first
  std::vector<uint64_t> counts;  // [n] counts[i] of ids[i], non-increasing

  // Ranks per-id counts ([n_vocab] counts indexed by token id): by count, ties by id.
  static TokenFrequencies from_counts(const std::vector<uint64_t>& count_of_id);
  // The k most frequent ids (all of them when k >= size).
  std::vector<int32_t> top(int32_t k) const;
};

// Throws Error when the file cannot be written.
void write_freq_file(const std::string& path, const TokenFrequencies& freq);
// Reads and validates a file (magic, version, exact size, ids in range and distinct, counts
// ranked and summing to total). expected_vocab > 0: the file must have been counted with a
// vocabulary of that size. Throws Error with the reason otherwise.
TokenFrequencies read_freq_file(const std::string& path, int32_t expected_vocab);

}  // namespace microspec
