#include "grammar/grammar.h"

#include <algorithm>
#include <functional>

#include "util/error.h"

namespace microspec {

namespace {
// A grammar whose stacks grow past this is malformed (build() refuses left recursion, so only an
// absurdly deep nesting of rules gets here); throwing beats exhausting memory.
constexpr int32_t kMaxStackDepth = 4096;
constexpr int64_t kMaxExpandSteps = 1 << 22;
}  // namespace

ByteSet ByteSet::range(uint8_t lo, uint8_t hi) { return ByteSet{}.add(lo, hi); }

ByteSet& ByteSet::add(uint8_t lo, uint8_t hi) {
  for (int b = lo; b <= hi; ++b) bits[size_t(b) >> 6] |= uint64_t(1) << (b & 63);
  return *this;
}

Sequence operator+(Sequence a, const Sequence& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---- recognizer ----

void Grammar::expand(GrammarScratch& s) const {
  // Work list of stacks still to resolve, each stored as positions then its depth (popped from
  // the back). s.stack is the one being resolved; resolved stacks go to the arena.
  std::vector<int32_t>& work = s.work;
  work.clear();
  work.insert(work.end(), s.stack.begin(), s.stack.end());
  work.push_back(static_cast<int32_t>(s.stack.size()));
  std::vector<int32_t>& cur = s.stack;
  int64_t steps = 0;
  while (!work.empty()) {
    const int32_t depth = work.back();
    work.pop_back();
    cur.assign(work.end() - depth, work.end());
    work.resize(work.size() - size_t(depth));
    for (;;) {
      if (++steps > kMaxExpandSteps || int32_t(cur.size()) > kMaxStackDepth)
        throw Error("grammar: the rules nest too deeply to match");
      if (cur.empty() || elems_[size_t(cur.back())].kind == ElemKind::Bytes) {  // resolved
        s.found.emplace_back(static_cast<int32_t>(s.arena.size()), static_cast<int32_t>(cur.size()));
        s.arena.insert(s.arena.end(), cur.begin(), cur.end());
        break;
      }
      const int32_t p = cur.back();
      cur.pop_back();
      const Elem e = elems_[size_t(p)];
      if (e.kind == ElemKind::End) continue;  // the alternative ended: resolve what comes after it
      // A rule: continue after the reference once it ends (nothing to push when the reference
      // ends its alternative), and begin each of its alternatives on top.
      if (elems_[size_t(p) + 1].kind != ElemKind::End) cur.push_back(p + 1);
      const std::vector<int32_t>& alts = rule_alts_[size_t(e.index)];
      for (size_t a = 1; a < alts.size(); ++a) {
        work.insert(work.end(), cur.begin(), cur.end());
        work.push_back(alts[a]);
        work.push_back(static_cast<int32_t>(cur.size()) + 1);
      }
      cur.push_back(alts[0]);
    }
  }
}

void Grammar::collect(GrammarState& out, GrammarScratch& s) const {
  const int32_t* base = s.arena.data();
  auto less = [base](const std::pair<int32_t, int32_t>& a, const std::pair<int32_t, int32_t>& b) {
    if (a.second != b.second) return a.second < b.second;
    return std::lexicographical_compare(base + a.first, base + a.first + a.second, base + b.first,
                                        base + b.first + b.second);
  };
  auto same = [base](const std::pair<int32_t, int32_t>& a, const std::pair<int32_t, int32_t>& b) {
    return a.second == b.second && std::equal(base + a.first, base + a.first + a.second, base + b.first);
  };
  std::sort(s.found.begin(), s.found.end(), less);
  s.found.erase(std::unique(s.found.begin(), s.found.end(), same), s.found.end());
  out.flat.clear();
  for (const auto& [offset, depth] : s.found) {
    out.flat.push_back(depth);
    out.flat.insert(out.flat.end(), base + offset, base + offset + depth);
  }
}

void Grammar::start(GrammarState& out, GrammarScratch& s) const {
  s.arena.clear();
  s.found.clear();
  for (int32_t alt : rule_alts_[size_t(root_)]) {
    s.stack.assign(1, alt);
    expand(s);
  }
  collect(out, s);
}

void Grammar::advance(const GrammarState& in, uint8_t byte, GrammarState& out, GrammarScratch& s) const {
  s.arena.clear();
  s.found.clear();
  for (size_t i = 0; i < in.flat.size();) {
    const int32_t depth = in.flat[i];
    const int32_t* stack = in.flat.data() + i + 1;
    i += size_t(depth) + 1;
    if (depth == 0) continue;  // complete: nothing may follow
    const int32_t top = stack[depth - 1];
    if (!sets_[size_t(elems_[size_t(top)].index)].has(byte)) continue;
    s.stack.assign(stack, stack + depth);
    s.stack.back() = top + 1;  // past the matched byte set
    expand(s);
  }
  collect(out, s);
}

bool Grammar::advance_bytes(GrammarState& state, std::string_view bytes, GrammarScratch& s) const {
  for (char c : bytes) {
    advance(state, static_cast<uint8_t>(c), s.tmp, s);
    state.flat.swap(s.tmp.flat);
    if (state.dead()) return false;
  }
  return true;
}

bool Grammar::complete(const GrammarState& state) {
  for (size_t i = 0; i < state.flat.size(); i += size_t(state.flat[i]) + 1)
    if (state.flat[i] == 0) return true;
  return false;
}

bool Grammar::accepts(const GrammarState& state, uint8_t byte) const {
  for (size_t i = 0; i < state.flat.size(); i += size_t(state.flat[i]) + 1) {
    const int32_t depth = state.flat[i];
    if (depth > 0 && sets_[size_t(elems_[size_t(state.flat[i + size_t(depth)])].index)].has(byte)) return true;
  }
  return false;
}

// ---- builder ----

Symbol Grammar::Builder::rule(std::string name) {
  g_.rule_names_.push_back(std::move(name));
  alts_.emplace_back();
  return {Symbol::Kind::Rule, static_cast<int32_t>(alts_.size()) - 1};
}

void Grammar::Builder::add(Symbol r, Sequence alternative) {
  if (r.kind != Symbol::Kind::Rule || r.index < 0 || size_t(r.index) >= alts_.size())
    throw Error("grammar builder: not a rule of this builder");
  alts_[size_t(r.index)].push_back(std::move(alternative));
}

Symbol Grammar::Builder::alt(std::string name, std::vector<Sequence> alternatives) {
  const Symbol r = rule(std::move(name));
  for (Sequence& a : alternatives) add(r, std::move(a));
  return r;
}

Symbol Grammar::Builder::bytes(const ByteSet& set) {
  for (size_t i = 0; i < g_.sets_.size(); ++i)
    if (g_.sets_[i] == set) return {Symbol::Kind::Bytes, static_cast<int32_t>(i)};
  g_.sets_.push_back(set);
  return {Symbol::Kind::Bytes, static_cast<int32_t>(g_.sets_.size()) - 1};
}

Sequence Grammar::Builder::lit(std::string_view text) {
  Sequence s;
  for (char c : text) s.push_back(bytes(ByteSet::of(static_cast<uint8_t>(c))));
  return s;
}

Symbol Grammar::Builder::repeat(std::string name, const Sequence& seq, int32_t min, int32_t max) {
  if (min < 0 || (max >= 0 && max < min)) throw Error("grammar builder: bad repetition bounds for " + name);
  Sequence head;
  for (int32_t i = 0; i < min; ++i) head = head + seq;
  Symbol tail{};
  bool has_tail = false;
  if (max < 0) {  // tail ::= seq tail | ()
    tail = rule(name + "-more");
    add(tail, seq + tail);
    add(tail, {});
    has_tail = true;
  } else {  // tail_k ::= seq tail_{k-1} | (), k = max - min optional copies
    for (int32_t k = 1; k <= max - min; ++k) {
      const Symbol t = rule(name + "-upto" + std::to_string(k));
      add(t, has_tail ? seq + tail : seq);
      add(t, {});
      tail = t;
      has_tail = true;
    }
  }
  return alt(std::move(name), {has_tail ? head + tail : head});
}

Grammar Grammar::Builder::build(Symbol root) && {
  const size_t n = alts_.size();
  for (size_t r = 0; r < n; ++r)
    if (alts_[r].empty()) throw Error("grammar: rule '" + g_.rule_names_[r] + "' has no alternative");
  // Nullable rules (a fixpoint), then the rules each rule can begin with: a rule reachable from
  // itself that way recurses on the left and would expand forever.
  std::vector<char> nullable(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const Sequence& a : alts_[r]) {
        const bool all = std::all_of(a.begin(), a.end(), [&](const Symbol& s) {
          return s.kind == Symbol::Kind::Rule && nullable[size_t(s.index)];
        });
        if (all) {
          nullable[r] = 1;
          changed = true;
          break;
        }
      }
    }
  }
  std::vector<std::vector<int32_t>> leftmost(n);
  for (size_t r = 0; r < n; ++r)
    for (const Sequence& a : alts_[r])
      for (const Symbol& s : a) {
        if (s.kind == Symbol::Kind::Bytes) break;
        leftmost[r].push_back(s.index);
        if (!nullable[size_t(s.index)]) break;
      }
  std::vector<char> mark(n, 0);  // 0 unseen, 1 on the current path, 2 done
  std::function<void(int32_t)> visit = [&](int32_t r) {
    mark[size_t(r)] = 1;
    for (int32_t s : leftmost[size_t(r)]) {
      if (mark[size_t(s)] == 1) throw Error("grammar: rule '" + g_.rule_names_[size_t(s)] + "' recurses on the left");
      if (mark[size_t(s)] == 0) visit(s);
    }
    mark[size_t(r)] = 2;
  };
  for (size_t r = 0; r < n; ++r)
    if (mark[r] == 0) visit(static_cast<int32_t>(r));
  // Flatten.
  g_.rule_alts_.assign(n, {});
  for (size_t r = 0; r < n; ++r)
    for (const Sequence& a : alts_[r]) {
      g_.rule_alts_[r].push_back(static_cast<int32_t>(g_.elems_.size()));
      for (const Symbol& s : a)
        g_.elems_.push_back({s.kind == Symbol::Kind::Rule ? ElemKind::Rule : ElemKind::Bytes, s.index});
      g_.elems_.push_back({ElemKind::End, 0});
    }
  g_.root_ = root.index;
  return std::move(g_);
}

}  // namespace microspec
