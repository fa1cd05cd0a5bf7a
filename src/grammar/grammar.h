#pragma once
// A context-free grammar over bytes and its recognizer: what structured output (grammar/
// json_schema.h) compiles a JSON Schema to, and what masks the tokens a sequence may produce next
// (grammar/token_constraint.h).
//
// A grammar is a set of rules; a rule is a list of alternatives; an alternative is a sequence of
// symbols, each a byte set or a reference to a rule. Rules may recurse, but not on the left (a
// rule must consume a byte before it can reach itself again): build() refuses left recursion.
//
// The recognizer keeps every way the bytes so far can continue as a set of stacks. A stack is a
// list of positions in the grammar's flattened alternatives, the top one (the last) the next byte
// set to match and the ones below it where to continue once the alternative above ends. A state
// is the canonical (sorted, deduplicated) set of such stacks; an empty stack means the root rule
// is complete. States live in flat int buffers so that advancing, copying and comparing them
// allocates nothing once the buffers have grown.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace microspec {

// A set of byte values.
struct ByteSet {
  std::array<uint64_t, 4> bits{};
  static ByteSet of(uint8_t b) { return range(b, b); }
  static ByteSet range(uint8_t lo, uint8_t hi);
  ByteSet& add(uint8_t lo, uint8_t hi);
  bool has(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1u; }
  bool operator==(const ByteSet&) const = default;
};

// A symbol of an alternative: a byte set or a rule.
struct Symbol {
  enum class Kind : uint8_t { Bytes, Rule };
  Kind kind = Kind::Bytes;
  int32_t index = 0;  // into the builder's byte sets, or a rule id
};
using Sequence = std::vector<Symbol>;

// One set of stacks (see the top of this file): [stacks][1 + depth], each stack stored as its
// depth followed by its positions, bottom first; canonical order, no duplicates.
struct GrammarState {
  std::vector<int32_t> flat;
  bool dead() const { return flat.empty(); }
  bool operator==(const GrammarState&) const = default;
};

// Buffers the recognizer works in, passed in so that nothing is allocated per byte.
struct GrammarScratch {
  std::vector<int32_t> stack;                 // the stack being expanded
  std::vector<int32_t> work;                  // stacks still to expand: [positions..., depth] each
  std::vector<int32_t> arena;                 // candidate stacks: [depth, positions...] each
  std::vector<std::pair<int32_t, int32_t>> found;  // (offset, depth) of each candidate in arena
  GrammarState tmp;                           // advance_bytes' other buffer
  GrammarState probe;                         // a state tried without changing the caller's
};

class Grammar {
 public:
  class Builder;

  // The start state: every way the root rule can begin.
  void start(GrammarState& out, GrammarScratch& scratch) const;
  // The state after one more byte; dead (empty) when no stack accepts it. `in` and `out` differ.
  void advance(const GrammarState& in, uint8_t byte, GrammarState& out, GrammarScratch& scratch) const;
  // Advances `state` in place by every byte of `bytes`; false (state dead) once one is refused.
  bool advance_bytes(GrammarState& state, std::string_view bytes, GrammarScratch& scratch) const;
  // Whether the bytes so far form a complete sentence of the root rule.
  static bool complete(const GrammarState& state);
  // Whether some stack's next byte set holds `byte` (advance would not die).
  bool accepts(const GrammarState& state, uint8_t byte) const;

 private:
  enum class ElemKind : uint8_t { End, Bytes, Rule };
  struct Elem {
    ElemKind kind;
    int32_t index;  // Bytes: into sets_; Rule: rule id
  };
  // Pushes into scratch every stack that `stack` (top: the next element to resolve) expands to:
  // those whose top is a byte set, and the empty stack once the root completes.
  void expand(GrammarScratch& scratch) const;
  void collect(GrammarState& out, GrammarScratch& scratch) const;

  std::vector<Elem> elems_;                     // every alternative's symbols, each ended by End
  std::vector<std::vector<int32_t>> rule_alts_;  // [rules][alternatives] start position in elems_
  std::vector<std::string> rule_names_;          // [rules] for the builder's errors
  std::vector<ByteSet> sets_;                    // byte sets, by Bytes index
  int32_t root_ = 0;
};

// Builds a grammar rule by rule. Sequences are written with lit() and bytes(); the other helpers
// add rules for the usual repetitions and return a reference to them.
class Grammar::Builder {
 public:
  // A new rule with no alternatives yet (add them with add()); names appear in build()'s errors.
  Symbol rule(std::string name);
  void add(Symbol rule, Sequence alternative);
  // A new rule whose alternatives are these.
  Symbol alt(std::string name, std::vector<Sequence> alternatives);
  Symbol bytes(const ByteSet& set);
  // The bytes of `text`, one symbol each.
  Sequence lit(std::string_view text);
  // seq repeated at least min times and at most max (max < 0: no limit).
  Symbol repeat(std::string name, const Sequence& seq, int32_t min, int32_t max);
  Symbol optional(std::string name, const Sequence& seq) { return repeat(std::move(name), seq, 0, 1); }
  // Checks every rule has an alternative and none recurses on the left; throws Error otherwise.
  Grammar build(Symbol root) &&;

 private:
  Grammar g_;
  std::vector<std::vector<Sequence>> alts_;  // [rules] alternatives as written
};

// Concatenation, for writing sequences.
Sequence operator+(Sequence a, const Sequence& b);
inline Sequence operator+(Sequence a, Symbol b) {
  a.push_back(b);
  return a;
}

}  // namespace microspec
