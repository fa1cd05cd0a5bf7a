#pragma once
// The syntax tree of a Jinja template: expressions and statements, as the parser builds them and
// the evaluator walks them.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat_template/jinja_value.h"

namespace microspec::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
using KeywordArgs = std::vector<std::pair<std::string, ExprPtr>>;

enum class ExprKind {
  Literal,  // value
  Name,     // name
  List,     // args: items (tuple when is_tuple)
  Dict,     // args: key, value, key, value...
  Attr,     // args[0].name
  Index,    // args[0][args[1]]
  Slice,    // args[0][args[1]:args[2]:args[3]], each of the three may be null
  Call,     // args[0](args[1:], keywords)
  Filter,   // args[0] | name(args[1:], keywords); args[0] is null in a {% filter %} block
  Test,     // args[0] is [not] name(args[1:])
  Unary,    // name ("-", "+", "not") args[0]
  Binary,   // args[0] name args[1]: + - * / // % ** ~ and or
  Compare,  // args[0] ops[0] args[1] ops[1] args[2]... (== != < <= > >= in notin)
  Cond,     // args[0] if args[1] else args[2] (args[2] may be null)
};

struct Expr {
  ExprKind kind;
  int line = 0;
  int height = 1;  // longest chain of children below, this node included (the parser bounds it)
  Value value;
  std::string name;
  bool negated = false;  // Test: "is not"
  bool is_tuple = false;
  std::vector<ExprPtr> args;
  KeywordArgs keywords;
  std::vector<std::string> ops;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

enum class NodeKind {
  Text,         // text
  Output,       // {{ expr }}
  If,           // branches: (condition, body)...; else_body
  For,          // {% for targets in expr if condition %} body {% else %} else_body
  Set,          // {% set targets = expr %} or {% set targets[0].attr = expr %}
  SetBlock,     // {% set targets[0] %} body {% endset %}
  Macro,        // {% macro name(params) %} body
  CallBlock,    // {% call(params) expr %} body: body is the caller()
  FilterBlock,  // {% filter expr %} body (expr is a Filter with a null operand)
  Break,
  Continue,
  Scope,  // {% generation %} body: rendered as is, in a scope of its own
};

struct Branch {
  ExprPtr condition;
  Body body;
};

struct Node {
  NodeKind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;  // For: the inline filter
  std::vector<std::string> targets;
  std::string attr;    // Set: ns.attr
  std::string name;    // Macro
  KeywordArgs params;  // Macro / CallBlock: parameters with their defaults (null: none)
  std::vector<Branch> branches;
  Body body, else_body;
};

}  // namespace microspec::jinja
