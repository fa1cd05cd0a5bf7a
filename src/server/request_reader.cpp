#include "server/request_reader.h"

#include <boost/beast/http/error.hpp>

namespace microspec::server {

namespace http = boost::beast::http;
using boost::beast::error_code;
using boost::beast::string_view;

namespace {

std::string_view view(string_view s) {
  return {s.data(), s.size()};
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = char(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = char(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

std::string body_too_large_message(size_t limit) {
  return "Request body too large: the limit is " + std::to_string(limit) + " bytes (--max-body).";
}

}  // namespace

RequestReader::RequestReader(const TransportLimits& limits) : limits_(limits) {
  parser_.emplace(*this);
  parser_->header_limit(static_cast<std::uint32_t>(limits_.max_header_bytes));
  // Our own body handlers enforce max_body_bytes (and keep reading, dropping, to resynchronize);
  // the parser's limit bounds how much is dropped.
  parser_->body_limit(uint64_t(limits_.max_body_bytes) * (kDrainFactor + 1));
}

bool RequestReader::head_done() const {
  return parser_->is_header_done();
}

void RequestReader::fail(int status, std::string message) {
  if (status_ != 0) return;  // the first reason wins
  status_ = status;
  message_ = std::move(message);
}

void RequestReader::take_body(std::string_view bytes) {
  if (too_large_) return;
  if (request_.body().size() + bytes.size() > limits_.max_body_bytes) {
    too_large_ = true;
    request_.body().clear();
    request_.body().shrink_to_fit();
    return;
  }
  request_.body().append(bytes.data(), bytes.size());
}

size_t RequestReader::feed(std::string_view data) {
  if (state_ != State::NeedMore || data.empty()) return 0;
  started_ = true;
  size_t used = 0;
  while (used < data.size() && !parser_->is_done()) {
    const bool in_head = !parser_->is_header_done();
    // Not eager in the head: put() returns when the head is complete, so head bytes are counted
    // apart from the body's.
    parser_->eager(!in_head);
    error_code ec;
    const size_t n = parser_->put(boost::asio::const_buffer(data.data() + used, data.size() - used), ec);
    used += n;
    if (in_head) head_bytes_ += n;
    const bool need_more = ec == http::error::need_more;
    // Beast takes complete header lines as they come, so its own header limit bounds one put()
    // only: the head's total is checked here, with what is still waiting.
    if ((!ec || need_more) && in_head &&
        head_bytes_ + (parser_->is_header_done() ? 0 : data.size() - used) > limits_.max_header_bytes)
      ec = http::error::header_limit;
    else if (need_more)
      break;
    if (ec) {
      finish_failed_parse(ec);
      return used;
    }
    if (n == 0) break;
  }
  if (!parser_->is_done() && data.size() - used > limits_.max_header_bytes) {
    // Beast waits for a whole line (a chunk header with endless extensions, a trailer): bound it.
    fail(400, "Malformed HTTP request (a line longer than " + std::to_string(limits_.max_header_bytes) + " bytes).");
    keep_connection_ = false;
    state_ = State::Failed;
    return used;
  }
  if (parser_->is_done()) {
    if (too_large_) {
      fail(413, body_too_large_message(limits_.max_body_bytes));
      keep_connection_ = parser_->keep_alive();
      state_ = State::Failed;
    } else {
      state_ = State::Complete;
    }
  }
  return used;
}

void RequestReader::finish_failed_parse(const error_code& ec) {
  if (ec == http::error::header_limit) {
    if (line_done_)
      fail(431, "Request header section too large: the limit is " + std::to_string(limits_.max_header_bytes) +
                    " bytes.");
    else
      fail(414, "Request line too long: the limit is " + std::to_string(limits_.max_header_bytes) + " bytes.");
  } else if (ec == http::error::body_limit) {
    fail(413, body_too_large_message(limits_.max_body_bytes));
  } else if (ec == http::error::bad_version) {
    fail(505, "HTTP version not supported: this server speaks HTTP/1.0 and HTTP/1.1.");
  } else {
    fail(400, "Malformed HTTP request (" + ec.message() + ").");
  }
  keep_connection_ = false;
  state_ = State::Failed;
}

void RequestReader::end_of_input() {
  if (state_ != State::NeedMore || !started_) return;
  fail(400, "Malformed HTTP request (the connection ended inside it).");
  keep_connection_ = false;
  state_ = State::Failed;
}

void RequestReader::Parser::on_request_impl(http::verb method, string_view method_str, string_view target,
                                            int version, error_code& ec) {
  RequestReader& r = owner_;
  if (version != 10 && version != 11) {
    r.fail(505, "HTTP version not supported: this server speaks HTTP/1.0 and HTTP/1.1.");
    ec = http::error::bad_version;
    return;
  }
  if (method == http::verb::unknown) {
    r.fail(400, "Unknown HTTP method '" + std::string(view(method_str).substr(0, 32)) + "'.");
    ec = http::error::bad_method;
    return;
  }
  if (target.size() > r.limits_.max_target_bytes) {
    r.fail(414, "Request URI too long: the limit is " + std::to_string(r.limits_.max_target_bytes) + " bytes.");
    ec = http::error::bad_target;
    return;
  }
  r.line_done_ = true;
  r.request_.method(method);
  r.request_.target(target);
  r.request_.version(version);
}

void RequestReader::Parser::on_response_impl(int, string_view, int, error_code& ec) {
  ec = http::error::bad_method;  // never called for a request parser
}

void RequestReader::Parser::on_field_impl(http::field name, string_view name_string, string_view value,
                                          error_code& ec) {
  RequestReader& r = owner_;
  if (++r.fields_ > r.limits_.max_header_fields) {
    r.fail(431, "Too many request header fields: the limit is " + std::to_string(r.limits_.max_header_fields) + ".");
    ec = http::error::header_limit;
    return;
  }
  if (name == http::field::transfer_encoding && !iequals(view(value), "chunked")) {
    // Other transfer codings (gzip, ...) would have to be decoded, under the same limits; none is.
    r.fail(501, "Transfer-Encoding '" + std::string(view(value).substr(0, 64)) + "' is not supported (only chunked).");
    ec = http::error::bad_transfer_encoding;
    return;
  }
  r.request_.insert(name, name_string, value);
}

void RequestReader::Parser::on_header_impl(error_code& ec) {
  RequestReader& r = owner_;
  const auto expect = r.request_.find(http::field::expect);
  r.expects_continue_ = expect != r.request_.end() && iequals(view(expect->value()), "100-continue");
  const auto length = content_length();
  if (!length || *length <= r.limits_.max_body_bytes) return;
  // Known too large before a byte of it is read: a client waiting for 100 Continue, or a body too
  // long to drop, is answered at once (and the connection ends); else the body is dropped as it
  // comes so the connection can go on.
  r.too_large_ = true;
  const bool waits_for_continue = r.expects_continue_;
  r.expects_continue_ = false;
  if (waits_for_continue || *length > r.limits_.max_body_bytes * (kDrainFactor + 1)) {
    r.fail(413, body_too_large_message(r.limits_.max_body_bytes));
    ec = http::error::body_limit;
  }
}

void RequestReader::Parser::on_body_init_impl(const boost::optional<std::uint64_t>& content_length,
                                              error_code&) {
  RequestReader& r = owner_;
  if (content_length && !r.too_large_) r.request_.body().reserve(size_t(*content_length));
}

std::size_t RequestReader::Parser::on_body_impl(string_view body, error_code&) {
  owner_.take_body(view(body));
  return body.size();
}

void RequestReader::Parser::on_chunk_header_impl(std::uint64_t, string_view, error_code&) {}

std::size_t RequestReader::Parser::on_chunk_body_impl(std::uint64_t, string_view body, error_code&) {
  owner_.take_body(view(body));
  return body.size();
}

void RequestReader::Parser::on_finish_impl(error_code&) {}

}  // namespace microspec::server
