#pragma once
// Reads one HTTP/1.x request from bytes as they arrive, with the transport's limits: Boost.Beast's
// request parser (basic_parser) with our own handlers for the request line, fields and body, so
// every limit is checked on the bytes as they come in. No I/O here: the transport feeds it what
// it reads from a socket, the fuzzer feeds it arbitrary bytes.
#include <boost/beast/http/basic_parser.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "server/transport.h"

namespace microspec::server {

class RequestReader {
 public:
  // The rest of an oversized body is read and dropped up to this many times the body limit, so the
  // connection can carry the next request; a longer body ends the connection.
  static constexpr uint64_t kDrainFactor = 16;

  enum class State {
    NeedMore,  // give it more bytes
    Complete,  // request() is ready; bytes after it belong to the next request
    Failed,    // status()/message() say what to answer; keep_connection() whether the connection
               // can go on (only after a fully drained oversized body)
  };

  explicit RequestReader(const TransportLimits& limits);

  // Consumes a prefix of `data` and returns its length; the rest must be given again, with more
  // bytes after it, on the next call.
  size_t feed(std::string_view data);
  // The connection ended: a request in progress is malformed (400), none in progress is nothing.
  void end_of_input();

  State state() const { return state_; }
  bool started() const { return started_; }  // some byte of this request has been read
  bool head_done() const;
  // The head asked for "100 Continue" before its body is sent (and the body fits the limit).
  bool expects_continue() const { return expects_continue_; }
  int status() const { return status_; }
  const std::string& message() const { return message_; }
  bool keep_connection() const { return keep_connection_; }
  HttpRequest& request() { return request_; }

 private:
  class Parser : public boost::beast::http::basic_parser<true> {
   public:
    explicit Parser(RequestReader& owner) : owner_(owner) {}

   private:
    RequestReader& owner_;
    void on_request_impl(boost::beast::http::verb method, boost::beast::string_view method_str,
                         boost::beast::string_view target, int version, boost::beast::error_code& ec) override;
    void on_response_impl(int, boost::beast::string_view, int, boost::beast::error_code& ec) override;
    void on_field_impl(boost::beast::http::field name, boost::beast::string_view name_string,
                       boost::beast::string_view value, boost::beast::error_code& ec) override;
    void on_header_impl(boost::beast::error_code& ec) override;
    void on_body_init_impl(const boost::optional<std::uint64_t>& content_length,
                           boost::beast::error_code& ec) override;
    std::size_t on_body_impl(boost::beast::string_view body, boost::beast::error_code& ec) override;
    void on_chunk_header_impl(std::uint64_t size, boost::beast::string_view extensions,
                              boost::beast::error_code& ec) override;
    std::size_t on_chunk_body_impl(std::uint64_t remain, boost::beast::string_view body,
                                   boost::beast::error_code& ec) override;
    void on_finish_impl(boost::beast::error_code& ec) override;
  };

  void fail(int status, std::string message);
  void take_body(std::string_view bytes);
  void finish_failed_parse(const boost::beast::error_code& ec);

  TransportLimits limits_;
  std::optional<Parser> parser_;
  HttpRequest request_;
  State state_ = State::NeedMore;
  bool started_ = false;
  bool expects_continue_ = false;
  bool too_large_ = false;  // body past the limit: dropping the rest
  size_t fields_ = 0;
  size_t head_bytes_ = 0;  // bytes of the request line and header section taken so far
  bool line_done_ = false;  // the request line was read
  int status_ = 0;
  std::string message_;
  bool keep_connection_ = false;
};

}  // namespace microspec::server
