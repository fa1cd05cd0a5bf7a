// Recursive descent over the tokens. Expressions follow jinja2's precedence, lowest first:
// conditional (x if c else y), or, and, not, comparisons (== != < <= > >= in, not in), + -, ~,
// * / // %, **, unary - +, then primaries with their postfixes (.attr, [index], [a:b:c], (call))
// and filters / tests (| name, is name).
#include "chat_template/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "chat_template/jinja_builtins.h"
#include "chat_template/jinja_lexer.h"
#include "util/error.h"

namespace microspec::jinja {
namespace {

constexpr int kMaxDepth = 256;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_all() {
    std::string stop;
    Body body = parse_body({}, &stop, "");
    return body;
  }

 private:
  std::vector<Token> tokens_;
  size_t at_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;

  // --- tokens -----------------------------------------------------------------------------------

  const Token& peek(size_t ahead = 0) const {
    const size_t i = std::min(at_ + ahead, tokens_.size() - 1);
    return tokens_[i];
  }
  const Token& next() {
    const Token& t = peek();
    if (at_ < tokens_.size() - 1) ++at_;
    return t;
  }
  bool is_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::Op && peek(ahead).text == op;
  }
  bool is_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::Name && peek(ahead).text == name;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error("template line " + std::to_string(peek().line) + ": " + what);
  }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    fail("expected " + wanted + ", found " + describe(peek()));
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) unexpected("'" + std::string(op) + "'");
    next();
  }
  void expect_block_end(const std::string& tag) {
    if (peek().kind != TokenKind::BlockEnd) unexpected("end of the '" + tag + "' tag");
    next();
  }
  std::string expect_name(const std::string& what) {
    if (peek().kind != TokenKind::Name) unexpected(what);
    return next().text;
  }

  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.fail("template nested more than 256 levels deep");
    }
    ~DepthGuard() { --p.depth_; }
  };

  // Records e's height (its longest chain of children) and refuses a tree higher than kMaxDepth: a
  // chain the parser builds in a loop (a + b + c ..., x|f|g ..., x.a.b ...) nests as deeply as one
  // built by recursion, and everything that walks the tree (checks, evaluation, destruction)
  // recurses through it.
  ExprPtr sealed(ExprPtr e) {
    int height = 0;
    for (const ExprPtr& a : e->args)
      if (a) height = std::max(height, a->height);
    for (const auto& kw : e->keywords) height = std::max(height, kw.second->height);
    e->height = height + 1;
    if (e->height > kMaxDepth) fail("expression nested more than 256 levels deep");
    return e;
  }

  ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // --- statements -------------------------------------------------------------------------------

  // Nodes until a block tag whose name is one of `enders` (left unconsumed, its name in *stop), or
  // the end of the template where no ender is expected.
  Body parse_body(std::initializer_list<std::string_view> enders, std::string* stop,
                  const std::string& opener) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.kind == TokenKind::End) {
        if (enders.size() == 0) return body;
        fail("unexpected end of template: '" + opener + "' is not closed (expected '{% " +
             std::string(*enders.begin()) + " %}' or one of its companions)");
      }
      if (t.kind == TokenKind::Text) {
        auto node = std::make_unique<Node>();
        node->kind = NodeKind::Text;
        node->line = t.line;
        node->text = next().text;
        body.push_back(std::move(node));
      } else if (t.kind == TokenKind::VarBegin) {
        next();
        auto node = std::make_unique<Node>();
        node->kind = NodeKind::Output;
        node->line = t.line;
        node->expr = parse_tuple_or_expression();
        if (peek().kind != TokenKind::VarEnd) unexpected("'}}'");
        next();
        body.push_back(std::move(node));
      } else if (t.kind == TokenKind::BlockBegin) {
        const Token& tag = peek(1);
        if (tag.kind != TokenKind::Name) {
          next();
          unexpected("a tag name");
        }
        for (std::string_view e : enders) {
          if (tag.text == e) {
            next();
            *stop = next().text;
            return body;
          }
        }
        next();
        body.push_back(parse_statement());
      } else {
        unexpected("template text or a tag");
      }
    }
  }

  NodePtr parse_statement() {
    const Token& tag = next();
    const std::string& name = tag.text;
    auto node = std::make_unique<Node>();
    node->line = tag.line;
    if (name == "if") return parse_if(std::move(node));
    if (name == "for") return parse_for(std::move(node));
    if (name == "set") return parse_set(std::move(node));
    if (name == "macro") return parse_macro(std::move(node));
    if (name == "call") return parse_call_block(std::move(node));
    if (name == "filter") return parse_filter_block(std::move(node));
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail("'" + name + "' outside of a for loop");
      node->kind = name == "break" ? NodeKind::Break : NodeKind::Continue;
      expect_block_end(name);
      return node;
    }
    if (name == "generation") {
      node->kind = NodeKind::Scope;
      expect_block_end(name);
      std::string stop;
      node->body = parse_body({"endgeneration"}, &stop, "generation");
      expect_block_end("endgeneration");
      return node;
    }
    const bool known_end = name.starts_with("end") || name == "elif" || name == "else";
    fail(known_end ? "'{% " + name + " %}' without a matching opening tag"
                   : "unknown or unsupported tag '" + name + "'");
  }

  NodePtr parse_if(NodePtr node) {
    node->kind = NodeKind::If;
    std::string stop = "elif";
    while (stop == "elif") {
      Branch branch;
      branch.condition = parse_tuple_or_expression();
      expect_block_end("if");
      branch.body = parse_body({"elif", "else", "endif"}, &stop, "if");
      node->branches.push_back(std::move(branch));
    }
    if (stop == "else") {
      expect_block_end("else");
      node->else_body = parse_body({"endif"}, &stop, "if");
    }
    expect_block_end("endif");
    return node;
  }

  NodePtr parse_for(NodePtr node) {
    node->kind = NodeKind::For;
    node->targets = parse_targets();
    if (!is_name("in")) unexpected("'in'");
    next();
    node->expr = parse_or_level_tuple();
    if (is_name("if")) {
      next();
      node->condition = parse_expression();
    }
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_block_end("for");
    std::string stop;
    ++loop_depth_;
    node->body = parse_body({"else", "endfor"}, &stop, "for");
    --loop_depth_;
    if (stop == "else") {
      expect_block_end("else");
      node->else_body = parse_body({"endfor"}, &stop, "for");
    }
    expect_block_end("endfor");
    return node;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> targets;
    const bool parenthesized = is_op("(");
    if (parenthesized) next();
    targets.push_back(expect_name("a variable name"));
    while (is_op(",")) {
      next();
      targets.push_back(expect_name("a variable name"));
    }
    if (parenthesized) expect_op(")");
    return targets;
  }

  NodePtr parse_set(NodePtr node) {
    const std::string first = expect_name("a variable name after 'set'");
    if (is_op(".")) {
      next();
      node->kind = NodeKind::Set;
      node->targets = {first};
      node->attr = expect_name("an attribute name");
      expect_op("=");
      node->expr = parse_tuple_or_expression();
      expect_block_end("set");
      return node;
    }
    node->targets = {first};
    while (is_op(",")) {
      next();
      node->targets.push_back(expect_name("a variable name"));
    }
    if (is_op("=")) {
      next();
      node->kind = NodeKind::Set;
      node->expr = parse_tuple_or_expression();
      expect_block_end("set");
      return node;
    }
    if (node->targets.size() != 1) unexpected("'='");
    if (is_op("|")) fail("filters on a block set ('{% set x | filter %}') are not supported");
    node->kind = NodeKind::SetBlock;
    expect_block_end("set");
    std::string stop;
    node->body = parse_body({"endset"}, &stop, "set");
    expect_block_end("endset");
    return node;
  }

  KeywordArgs parse_params() {
    KeywordArgs params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string name = expect_name("a parameter name");
      ExprPtr default_value;
      if (is_op("=")) {
        next();
        default_value = parse_expression();
      } else if (!params.empty() && params.back().second) {
        fail("parameter '" + name + "' without a default follows one with a default");
      }
      params.emplace_back(std::move(name), std::move(default_value));
    }
    next();
    return params;
  }

  NodePtr parse_macro(NodePtr node) {
    node->kind = NodeKind::Macro;
    node->name = expect_name("a macro name");
    node->params = parse_params();
    expect_block_end("macro");
    std::string stop;
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    node->body = parse_body({"endmacro"}, &stop, "macro " + node->name);
    loop_depth_ = saved_loops;
    expect_block_end("endmacro");
    return node;
  }

  NodePtr parse_call_block(NodePtr node) {
    node->kind = NodeKind::CallBlock;
    if (is_op("(")) node->params = parse_params();
    node->expr = parse_expression();
    if (node->expr->kind != ExprKind::Call) fail("'{% call %}' needs a macro call");
    expect_block_end("call");
    std::string stop;
    node->body = parse_body({"endcall"}, &stop, "call");
    expect_block_end("endcall");
    return node;
  }

  NodePtr parse_filter_block(NodePtr node) {
    node->kind = NodeKind::FilterBlock;
    ExprPtr chain;  // the operand stays null: the block's output goes there
    do {
      if (chain) next();
      chain = parse_filter(std::move(chain));
    } while (is_op("|"));
    node->expr = std::move(chain);
    expect_block_end("filter");
    std::string stop;
    node->body = parse_body({"endfilter"}, &stop, "filter");
    expect_block_end("endfilter");
    return node;
  }

  // --- expressions ------------------------------------------------------------------------------

  ExprPtr parse_tuple_or_expression() {
    const int line = peek().line;
    ExprPtr first = parse_expression();
    if (!is_op(",")) return first;
    auto tuple = make(ExprKind::List, line);
    tuple->is_tuple = true;
    tuple->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().kind == TokenKind::VarEnd || peek().kind == TokenKind::BlockEnd) break;
      tuple->args.push_back(parse_expression());
    }
    return sealed(std::move(tuple));
  }

  // A for loop's iterable: no conditional expression at the top (its "if" filters the loop).
  ExprPtr parse_or_level_tuple() {
    const int line = peek().line;
    ExprPtr first = parse_or();
    if (!is_op(",")) return first;
    auto tuple = make(ExprKind::List, line);
    tuple->is_tuple = true;
    tuple->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      tuple->args.push_back(parse_or());
    }
    return sealed(std::move(tuple));
  }

  ExprPtr parse_expression() {
    DepthGuard guard(*this);
    const int line = peek().line;
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      next();
      auto cond = make(ExprKind::Cond, line);
      cond->args.push_back(std::move(expr));
      cond->args.push_back(parse_or());
      if (is_name("else")) {
        next();
        cond->args.push_back(parse_expression());
      } else {
        cond->args.push_back(nullptr);
      }
      expr = sealed(std::move(cond));
    }
    return expr;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(ExprKind::Binary, line);
    e->name = std::move(op);
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return sealed(std::move(e));
  }

  // The operator of `ops` (symbols, or names such as "and") the next token is, else null.
  const char* next_operator(std::initializer_list<const char*> ops) {
    for (const char* op : ops)
      if (is_op(op) || is_name(op)) return op;
    return nullptr;
  }

  // One left-associative level of binary operators: operands parsed by `operand`, joined by `ops`.
  template <class Operand>
  ExprPtr left_associative(std::initializer_list<const char*> ops, Operand operand) {
    ExprPtr left = operand();
    while (const char* op = next_operator(ops)) {
      const int line = next().line;
      left = binary(op, std::move(left), operand(), line);
    }
    return left;
  }

  ExprPtr parse_or() { return left_associative({"or"}, [&] { return parse_and(); }); }
  ExprPtr parse_and() { return left_associative({"and"}, [&] { return parse_not(); }); }

  ExprPtr parse_not() {
    if (!is_name("not")) return parse_compare();
    DepthGuard guard(*this);
    auto e = make(ExprKind::Unary, next().line);
    e->name = "not";
    e->args.push_back(parse_not());
    return sealed(std::move(e));
  }

  ExprPtr parse_compare() {
    const int line = peek().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (peek().kind == TokenKind::Op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
           peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next(), next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::Compare, line);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? sealed(std::move(cmp)) : std::move(first);
  }

  ExprPtr parse_math1() { return left_associative({"+", "-"}, [&] { return parse_concat(); }); }
  ExprPtr parse_concat() { return left_associative({"~"}, [&] { return parse_math2(); }); }
  ExprPtr parse_math2() { return left_associative({"*", "/", "//", "%"}, [&] { return parse_pow(); }); }
  ExprPtr parse_pow() { return left_associative({"**"}, [&] { return parse_unary(WithFilters::Yes); }); }

  enum class WithFilters { No, Yes };

  ExprPtr parse_unary(WithFilters with_filters) {
    DepthGuard guard(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = make(ExprKind::Unary, t.line);
      e->name = t.text;
      e->args.push_back(parse_unary(WithFilters::No));
      e = sealed(std::move(e));
    } else {
      e = parse_postfix(parse_primary());
    }
    return with_filters == WithFilters::Yes ? parse_filters_and_tests(std::move(e)) : std::move(e);
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    switch (t.kind) {
      case TokenKind::Name: {
        next();
        auto lit = make(ExprKind::Literal, t.line);
        if (t.text == "true" || t.text == "True")
          lit->value = Value::from_bool(true);
        else if (t.text == "false" || t.text == "False")
          lit->value = Value::from_bool(false);
        else if (t.text == "none" || t.text == "None")
          lit->value = Value::none();
        else {
          auto name = make(ExprKind::Name, t.line);
          name->name = t.text;
          return name;
        }
        return lit;
      }
      case TokenKind::String: {
        auto lit = make(ExprKind::Literal, t.line);
        std::string text;
        while (peek().kind == TokenKind::String) text += next().text;  // "a" "b" is "ab"
        lit->value = Value::from_string(std::move(text));
        return lit;
      }
      case TokenKind::Int:
      case TokenKind::Float: {
        next();
        auto lit = make(ExprKind::Literal, t.line);
        lit->value = t.kind == TokenKind::Int ? Value::from_int(t.integer) : Value::from_float(t.number);
        return lit;
      }
      case TokenKind::Op:
        if (t.text == "(") return parse_parenthesized();
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    unexpected("an expression");
  }

  ExprPtr parse_parenthesized() {
    const int line = next().line;
    if (is_op(")")) {
      next();
      auto tuple = make(ExprKind::List, line);
      tuple->is_tuple = true;
      return sealed(std::move(tuple));
    }
    ExprPtr first = parse_expression();
    if (is_op(")")) {
      next();
      return first;
    }
    auto tuple = make(ExprKind::List, line);
    tuple->is_tuple = true;
    tuple->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (is_op(")")) break;
      tuple->args.push_back(parse_expression());
    }
    expect_op(")");
    return sealed(std::move(tuple));
  }

  ExprPtr parse_list() {
    auto list = make(ExprKind::List, next().line);
    while (!is_op("]")) {
      if (!list->args.empty()) expect_op(",");
      if (is_op("]")) break;
      list->args.push_back(parse_expression());
    }
    next();
    return sealed(std::move(list));
  }

  ExprPtr parse_dict() {
    auto dict = make(ExprKind::Dict, next().line);
    while (!is_op("}")) {
      if (!dict->args.empty()) expect_op(",");
      if (is_op("}")) break;
      dict->args.push_back(parse_expression());
      expect_op(":");
      dict->args.push_back(parse_expression());
    }
    next();
    return sealed(std::move(dict));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const int line = next().line;
        if (peek().kind == TokenKind::Int) {
          auto index = make(ExprKind::Index, line);
          auto key = make(ExprKind::Literal, line);
          key->value = Value::from_int(next().integer);
          index->args.push_back(std::move(e));
          index->args.push_back(std::move(key));
          e = sealed(std::move(index));
          continue;
        }
        auto attr = make(ExprKind::Attr, line);
        attr->name = expect_name("an attribute name after '.'");
        attr->args.push_back(std::move(e));
        e = sealed(std::move(attr));
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    DepthGuard guard(*this);
    const int line = next().line;
    ExprPtr parts[3];
    int colons = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        if (++colons > 2) unexpected("']'");
        next();
        continue;
      }
      if (parts[colons]) unexpected("':' or ']'");
      parts[colons] = parse_expression();
    }
    next();
    if (colons == 0) {
      if (!parts[0]) fail("empty subscript '[]'");
      auto index = make(ExprKind::Index, line);
      index->args.push_back(std::move(object));
      index->args.push_back(std::move(parts[0]));
      return sealed(std::move(index));
    }
    auto slice = make(ExprKind::Slice, line);
    slice->args.push_back(std::move(object));
    for (auto& p : parts) slice->args.push_back(std::move(p));
    return sealed(std::move(slice));
  }

  // (positional..., name=value...) into e->args (after what is already there) and e->keywords.
  void parse_arguments(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("'*args' and '**kwargs' in calls are not supported");
      if (peek().kind == TokenKind::Name && is_op("=", 1)) {
        std::string name = next().text;
        next();
        e.keywords.emplace_back(std::move(name), parse_expression());
      } else {
        if (!e.keywords.empty()) fail("positional argument after a keyword argument");
        e.args.push_back(parse_expression());
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr callee) {
    DepthGuard guard(*this);
    auto call = make(ExprKind::Call, peek().line);
    call->args.push_back(std::move(callee));
    parse_arguments(*call);
    return sealed(std::move(call));
  }

  ExprPtr parse_filter(ExprPtr operand) {
    auto f = make(ExprKind::Filter, peek().line);
    f->name = expect_name("a filter name");
    f->args.push_back(std::move(operand));
    if (is_op("(")) parse_arguments(*f);
    return sealed(std::move(f));
  }

  ExprPtr parse_filters_and_tests(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_test(ExprPtr operand) {
    DepthGuard guard(*this);
    auto t = make(ExprKind::Test, next().line);
    if (is_name("not")) {
      next();
      t->negated = true;
    }
    t->name = expect_name("a test name after 'is'");
    t->args.push_back(std::move(operand));
    const Token& n = peek();
    const bool starts_argument =
        n.kind == TokenKind::Name || n.kind == TokenKind::String || n.kind == TokenKind::Int ||
        n.kind == TokenKind::Float ||
        (n.kind == TokenKind::Op && (n.text == "(" || n.text == "[" || n.text == "{"));
    if (n.kind == TokenKind::Op && n.text == "(") {
      parse_arguments(*t);
    } else if (starts_argument && !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("'is' cannot follow a test name");
      t->args.push_back(parse_postfix(parse_primary()));
    }
    return sealed(std::move(t));
  }
};

// A filter or test name jinja2 does not know is a compile-time error in jinja2, except inside an
// {% if %} or a conditional expression (a "soft frame"), where it fails only when evaluated.
enum class Frame { Hard, Soft };

void check_names(const Expr* e, Frame frame) {
  if (!e) return;
  if (e->kind == ExprKind::Cond) frame = Frame::Soft;
  if (frame == Frame::Hard && e->kind == ExprKind::Filter && !jinja2_has_filter(e->name))
    throw Error("template line " + std::to_string(e->line) + ": no filter named '" + e->name + "'");
  if (frame == Frame::Hard && e->kind == ExprKind::Test && !jinja2_has_test(e->name))
    throw Error("template line " + std::to_string(e->line) + ": no test named '" + e->name + "'");
  for (const ExprPtr& a : e->args) check_names(a.get(), frame);
  for (const auto& kw : e->keywords) check_names(kw.second.get(), frame);
}

void check_names(const Body& body, Frame frame) {
  for (const NodePtr& n : body) {
    switch (n->kind) {
      case NodeKind::If:
        for (const Branch& b : n->branches) {
          check_names(b.condition.get(), Frame::Soft);
          check_names(b.body, Frame::Soft);
        }
        check_names(n->else_body, Frame::Soft);
        break;
      case NodeKind::For:
        check_names(n->expr.get(), frame);
        check_names(n->condition.get(), Frame::Hard);
        check_names(n->body, Frame::Hard);
        check_names(n->else_body, frame);
        break;
      case NodeKind::Macro:
      case NodeKind::CallBlock:
      case NodeKind::FilterBlock:
        for (const auto& p : n->params) check_names(p.second.get(), Frame::Hard);
        check_names(n->expr.get(), n->kind == NodeKind::FilterBlock ? Frame::Hard : frame);
        check_names(n->body, Frame::Hard);
        break;
      case NodeKind::SetBlock:
      case NodeKind::Scope:
        check_names(n->body, Frame::Hard);
        break;
      default:
        check_names(n->expr.get(), frame);
        break;
    }
  }
}

}  // namespace

Body parse_template(std::string_view source) {
  Body body = Parser(lex_template(source)).parse_all();
  check_names(body, Frame::Hard);
  return body;
}

}  // namespace microspec::jinja
