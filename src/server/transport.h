#pragma once
// The HTTP/1.1 transport of `microspec serve`, on Boost.Beast over Boost.Asio (Debian's
// libboost-dev). Connections are asynchronous: an idle or slow connection costs a small object and
// no thread; a few I/O threads read every request, answer the transport's own errors and write
// every response. The application's handler is called on an I/O thread with one complete request
// and must not block there: it answers at once or hands the Exchange to its own threads, which
// answer (or stream) from there.
//
// Limits, all decided while reading (nothing is buffered past them):
//   request line + header section  > max_header_bytes  -> 431 (414 when the request line alone is)
//   header fields                  > max_header_fields -> 431
//   request target                 > max_target_bytes  -> 414
//   body, on every route, whatever its framing (Content-Length or chunked; Content-Encoding is
//   never decoded, so a compressed body counts at its size on the wire) > max_body_bytes -> 413
//     (the rest of an oversized body is read and dropped up to kDrainFactor x the limit so the
//     connection stays usable; past that the connection is closed)
//   head and body not complete within request_timeout of their first byte -> 408, closed
//   keep-alive connection without a new request for idle_timeout -> closed
//   a response write that does not complete within write_timeout -> closed, and the exchange is
//     marked cancelled (a streaming generation stops at its next step)
//   open connections > max_connections -> the excess is answered 503 with one non-blocking write
//     and closed, before any of its bytes are read
#include <atomic>
#include <boost/beast/http/fields.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace microspec::server {

// The transport's limits, one table (the server's command-line options fill it).
struct TransportLimits {
  size_t max_header_bytes = 16 * 1024;  // request line and header section together
  size_t max_header_fields = 100;
  size_t max_target_bytes = 8 * 1024;
  size_t max_body_bytes = 1 << 20;
  std::chrono::milliseconds request_timeout{30'000};  // first byte of a request to the end of its body
  std::chrono::milliseconds idle_timeout{5'000};      // keep-alive connection waiting for its next request
  std::chrono::milliseconds write_timeout{30'000};    // one response write (a stream: each of its writes)
  int max_connections = 512;
  int io_threads = 1;
};

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// One request and its response. Made by the transport; the application answers it exactly once,
// with respond() or with start_stream() ... write() ... end_stream(), from any thread.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual const HttpRequest& request() const = 0;

  // A complete response (Content-Length framing).
  virtual void respond(int status, const HttpHeaders& headers, std::string content_type, std::string body) = 0;
  // Streaming: the head, then pieces of the body as they are made. HTTP/1.1 clients get chunked
  // framing; HTTP/1.0 clients get the body unframed, ended by closing the connection.
  virtual void start_stream(int status, const HttpHeaders& headers, std::string content_type) = 0;
  // Queues a piece; blocks the calling thread while more than a small amount is waiting to be
  // written (a reader that stops reading holds the writer back, until write_timeout ends the
  // connection). Returns false once the connection is gone: stop producing.
  virtual bool write(std::string data) = 0;
  virtual void end_stream() = 0;

  // Set when the client closed or reset its connection, or a write failed or timed out. A
  // generation working for this exchange watches it and stops at its next step.
  virtual const std::atomic<bool>& cancelled() const = 0;
};

// Called on an I/O thread for every complete request (never for requests the transport itself
// answers with an error). Must not block.
using HttpHandler = std::function<void(std::shared_ptr<Exchange>)>;
// Called once for every response status written, with the request target ("" when the request
// could not be parsed), for metrics.
using HttpObserver = std::function<void(std::string_view target, int status)>;
// The body of the transport's own error answers (the server's OpenAI-style JSON).
using HttpErrorBody = std::function<std::string(int status, const std::string& message)>;

class HttpTransport {
 public:
  HttpTransport(TransportLimits limits, HttpHandler handler, HttpObserver observer, HttpErrorBody error_body);
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds and listens; returns the bound port (port 0: any free one). Throws Error when it cannot.
  int listen(const std::string& host, int port);
  // Runs the I/O threads until stop(); returns when they have ended.
  void run();
  // Stops accepting; lets responses under way finish writing (up to `grace`), then ends run().
  void stop(std::chrono::milliseconds grace);

  int open_connections() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace microspec::server
