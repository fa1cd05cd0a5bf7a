#include "server/transport.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/beast/http/status.hpp>
#include <array>
#include <thread>

#include "server/request_reader.h"
#include "util/error.h"

namespace microspec::server {

namespace net = boost::asio;
namespace http = boost::beast::http;
using net::ip::tcp;
using boost::system::error_code;

namespace {

// A stream writer may run ahead of the socket by this much before write() blocks it.
constexpr size_t kStreamHighWater = 16 * 1024;
// Each connection's kernel send buffer (fixed, so not grown by autotuning to megabytes): answers
// are small or streamed, and a reader that stops reading is noticed after a few hundred events.
constexpr int kSendBufferBytes = 16 * 1024;
// After an answer that ends the connection, what the client still sends is read and dropped for
// this long (so the answer is not lost to a reset), then the socket is closed.
constexpr auto kLingerTime = std::chrono::milliseconds(1000);
constexpr size_t kReadChunk = 16 * 1024;

std::string status_line(int version, int status) {
  const auto reason = http::obsolete_reason(static_cast<http::status>(status));
  return std::string(version == 10 ? "HTTP/1.0 " : "HTTP/1.1 ") + std::to_string(status) + " " +
         std::string(reason.data(), reason.size()) + "\r\n";
}

std::string head_text(int version, int status, const HttpHeaders& headers, const std::string& content_type,
                      const std::string& framing, bool keep_alive) {
  std::string h = status_line(version, status);
  h += "Server: microspec\r\n";
  if (!content_type.empty()) h += "Content-Type: " + content_type + "\r\n";
  for (const auto& [name, value] : headers) h += name + ": " + value + "\r\n";
  h += framing;
  if (!keep_alive)
    h += "Connection: close\r\n";
  else if (version == 10)
    h += "Connection: keep-alive\r\n";
  h += "\r\n";
  return h;
}

}  // namespace

struct HttpTransport::Impl : std::enable_shared_from_this<HttpTransport::Impl> {
  TransportLimits limits;
  HttpHandler handler;
  HttpObserver observer;
  HttpErrorBody error_body;
  net::io_context io;
  tcp::acceptor acceptor{io};
  std::atomic<int> open{0};        // connections with a session
  std::atomic<int> responding{0};  // requests handed to the handler and not yet fully answered
  std::atomic<bool> stopping{false};

  Impl(TransportLimits l, HttpHandler h, HttpObserver o, HttpErrorBody e)
      : limits(std::move(l)), handler(std::move(h)), observer(std::move(o)), error_body(std::move(e)) {}

  void accept();
  void refuse(tcp::socket& socket);
};

namespace {

class Session;

class ExchangeImpl final : public Exchange {
 public:
  ExchangeImpl(std::shared_ptr<Session> session, HttpRequest request)
      : session_(std::move(session)), request_(std::move(request)) {}
  const HttpRequest& request() const override { return request_; }
  void respond(int status, const HttpHeaders& headers, std::string content_type, std::string body) override;
  void start_stream(int status, const HttpHeaders& headers, std::string content_type) override;
  bool write(std::string data) override;
  void end_stream() override;
  const std::atomic<bool>& cancelled() const override { return cancelled_; }

  // Called by the session (on its strand).
  void mark_cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }
  void written(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    queued_ -= std::min(queued_, n);
    cv_.notify_all();
  }

 private:
  std::shared_ptr<Session> session_;
  HttpRequest request_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  size_t queued_ = 0;    // bytes handed to the session and not yet written
  bool streaming_ = false;
  bool chunked_ = false;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(std::shared_ptr<HttpTransport::Impl> t, tcp::socket socket)
      : t_(std::move(t)),
        socket_(std::move(socket)),
        strand_(net::make_strand(t_->io)),
        read_timer_(strand_),
        write_timer_(strand_),
        reader_(std::make_unique<RequestReader>(t_->limits)) {
    ++t_->open;
  }
  ~Session() { --t_->open; }

  void start() {
    net::dispatch(strand_, [self = shared_from_this()] { self->next_request(); });
  }

  // --- called through ExchangeImpl, posted onto the strand ---
  // Queues bytes; `last`: the response ends with them.
  void send(std::string bytes, bool last, bool close_after) {
    net::post(strand_, [self = shared_from_this(), bytes = std::move(bytes), last, close_after]() mutable {
      self->enqueue(std::move(bytes), last, close_after);
    });
  }
  void record_status(int status) {
    if (!t_->observer) return;
    const auto target = exchange_ ? exchange_->request().target() : boost::beast::string_view();
    t_->observer(std::string_view(target.data(), target.size()), status);
  }
  void post_record_status(int status) {
    net::post(strand_, [self = shared_from_this(), status] { self->record_status(status); });
  }

 private:
  enum class Phase { Idle, Reading, Processing, Closing };

  std::shared_ptr<HttpTransport::Impl> t_;
  tcp::socket socket_;
  net::strand<net::io_context::executor_type> strand_;
  net::steady_timer read_timer_;   // idle, request and linger deadlines
  net::steady_timer write_timer_;  // write deadline
  std::unique_ptr<RequestReader> reader_;
  std::string in_;                    // [bytes] read and not yet consumed by the reader
  std::array<char, kReadChunk> chunk_;  // [kReadChunk] one read
  Phase phase_ = Phase::Idle;
  bool reading_ = false;
  bool read_timed_out_ = false;
  bool continue_sent_ = false;
  std::shared_ptr<ExchangeImpl> exchange_;
  std::deque<std::pair<std::string, bool>> out_;  // pieces to write; bool: the response ends with it
  std::string writing_;                           // the piece being written
  bool write_busy_ = false;
  bool writing_last_ = false;
  bool close_after_response_ = false;
  bool response_done_ = false;
  bool dead_ = false;
  bool peer_closed_ = false;  // the client closed or reset while its request was processed
  size_t lingered_ = 0;

  void next_request() {
    if (dead_) return;
    phase_ = Phase::Idle;
    reader_ = std::make_unique<RequestReader>(t_->limits);
    continue_sent_ = false;
    read_timed_out_ = false;
    if (!in_.empty()) {
      start_request_deadline();
      parse();
      return;
    }
    arm_read_timer(t_->limits.idle_timeout);
    if (!reading_) read_some();
  }

  void start_request_deadline() {
    phase_ = Phase::Reading;
    arm_read_timer(t_->limits.request_timeout);
  }

  void arm_read_timer(std::chrono::milliseconds after) {
    read_timer_.expires_after(after);
    read_timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec) return;  // re-armed or cancelled
      self->on_read_deadline();
    });
  }

  void on_read_deadline() {
    if (dead_) return;
    switch (phase_) {
      case Phase::Idle:
        close_now();  // keep-alive connection without a request
        break;
      case Phase::Reading:
        read_timed_out_ = true;
        fail_request(408, "Request timeout: the request head and body did not arrive within " +
                              std::to_string(t_->limits.request_timeout.count()) + " ms.");
        break;
      case Phase::Closing:
        close_now();  // done lingering
        break;
      case Phase::Processing:
        break;
    }
  }

  void read_some() {
    reading_ = true;
    socket_.async_read_some(net::buffer(chunk_), net::bind_executor(strand_, [self = shared_from_this()](
                                                                                 error_code ec, size_t n) {
      self->reading_ = false;
      self->on_read(ec, n);
    }));
  }

  void on_read(error_code ec, size_t n) {
    if (dead_) return;
    if (phase_ == Phase::Closing) {  // lingering: drop what comes until EOF or the deadline
      lingered_ += n;
      if (ec || lingered_ > 4 * kReadChunk * 64) return close_now();
      return read_some();
    }
    if (ec) {
      // The client went away (or reset). Whatever is being generated for it stops.
      if (phase_ == Phase::Processing) {
        if (exchange_) exchange_->mark_cancelled();
        peer_closed_ = true;
        return;  // the answer, if any, is dropped when it is written
      }
      if (phase_ == Phase::Reading) {
        reader_->end_of_input();
        if (reader_->state() == RequestReader::State::Failed) record_status_for_unparsed(400);
      }
      return close_now();
    }
    in_.append(chunk_.data(), n);
    if (phase_ == Phase::Processing) {
      // Pipelined bytes of the next request: keep them (bounded) and keep watching for EOF.
      if (in_.size() < t_->limits.max_header_bytes + kReadChunk) read_some();
      return;
    }
    if (phase_ == Phase::Idle) start_request_deadline();
    parse();
  }

  void record_status_for_unparsed(int status) {
    if (t_->observer) t_->observer("", status);
  }

  void parse() {
    const size_t used = reader_->feed(in_);
    in_.erase(0, used);
    switch (reader_->state()) {
      case RequestReader::State::NeedMore:
        if (reader_->head_done() && reader_->expects_continue() && !continue_sent_) {
          continue_sent_ = true;
          enqueue_raw("HTTP/1.1 100 Continue\r\n\r\n");
        }
        if (!reading_) read_some();
        return;
      case RequestReader::State::Failed:
        return fail_request(reader_->status(), reader_->message());
      case RequestReader::State::Complete:
        return dispatch();
    }
  }

  void dispatch() {
    read_timer_.cancel();
    phase_ = Phase::Processing;
    response_done_ = false;
    close_after_response_ = !reader_->request().keep_alive() || t_->stopping;
    exchange_ = std::make_shared<ExchangeImpl>(shared_from_this(), std::move(reader_->request()));
    ++t_->responding;
    // Watch the connection while the request is processed: EOF or reset cancels it.
    if (!reading_) read_some();
    try {
      t_->handler(exchange_);
    } catch (const std::exception& e) {
      exchange_->respond(500, {}, "application/json", t_->error_body(500, std::string("Internal error: ") + e.what()));
    }
  }

  // An error the transport answers itself; the connection ends afterwards unless the reader says
  // it is still in step (an oversized body that was dropped whole).
  void fail_request(int status, const std::string& message) {
    read_timer_.cancel();
    const bool keep = reader_->keep_connection() && !read_timed_out_ && !t_->stopping;
    const int version = reader_->head_done() && reader_->request().version() == 10 ? 10 : 11;
    const std::string body = t_->error_body(status, message);
    const std::string target = reader_->head_done() ? std::string(reader_->request().target()) : std::string();
    if (t_->observer) t_->observer(target, status);
    phase_ = Phase::Processing;
    response_done_ = false;
    close_after_response_ = !keep;
    enqueue(head_text(version, status, {}, "application/json",
                      "Content-Length: " + std::to_string(body.size()) + "\r\n", keep) +
                body,
            true, !keep);
  }

  void enqueue_raw(std::string bytes) {
    out_.emplace_back(std::move(bytes), false);
    pump();
  }

  void enqueue(std::string bytes, bool last, bool close_after) {
    if (close_after) close_after_response_ = true;
    out_.emplace_back(std::move(bytes), last);
    pump();
  }

  void pump() {
    if (write_busy_ || dead_) return;
    if (out_.empty()) return;
    // Gather what is queued into one write.
    writing_.clear();
    writing_last_ = false;
    while (!out_.empty() && !writing_last_) {
      writing_ += out_.front().first;
      writing_last_ = out_.front().second;
      out_.pop_front();
    }
    write_busy_ = true;
    write_timer_.expires_after(t_->limits.write_timeout);
    write_timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec) return;
      // The client stopped reading: the write never completed.
      if (self->exchange_) self->exchange_->mark_cancelled();
      self->close_now();
    });
    net::async_write(socket_, net::buffer(writing_),
                     net::bind_executor(strand_, [self = shared_from_this()](error_code ec, size_t n) {
                       self->on_written(ec, n);
                     }));
  }

  void on_written(error_code ec, size_t n) {
    write_timer_.cancel();
    write_busy_ = false;
    if (dead_) return;
    if (ec) {
      if (exchange_) exchange_->mark_cancelled();
      return close_now();
    }
    if (exchange_) exchange_->written(n);
    if (writing_last_) return response_finished();
    pump();
  }

  void response_finished() {
    if (exchange_) {
      exchange_.reset();
      --t_->responding;
    }
    response_done_ = true;
    if (close_after_response_ || peer_closed_ || t_->stopping) return linger_then_close();
    next_request();
  }

  // Half-closes, reads and drops what the client still sends for a moment, then closes: an answer
  // that ends the connection reaches the client instead of being lost to a reset.
  void linger_then_close() {
    phase_ = Phase::Closing;
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    if (peer_closed_) return close_now();
    arm_read_timer(kLingerTime);
    if (!reading_) read_some();
  }

 public:
  void close_now() {
    if (dead_) return;
    dead_ = true;
    error_code ignored;
    read_timer_.cancel();
    write_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    if (exchange_) {
      exchange_->mark_cancelled();
      exchange_.reset();
      --t_->responding;
    }
  }
};

void ExchangeImpl::respond(int status, const HttpHeaders& headers, std::string content_type, std::string body) {
  const bool keep = request_.keep_alive();
  std::string bytes = head_text(request_.version() == 10 ? 10 : 11, status, headers, content_type,
                                "Content-Length: " + std::to_string(body.size()) + "\r\n", keep);
  bytes += body;
  session_->post_record_status(status);
  session_->send(std::move(bytes), true, !keep);
}

void ExchangeImpl::start_stream(int status, const HttpHeaders& headers, std::string content_type) {
  streaming_ = true;
  chunked_ = request_.version() != 10;
  // HTTP/1.0 has no chunked framing: the body ends when the connection does.
  const bool keep = chunked_ && request_.keep_alive();
  std::string head = head_text(chunked_ ? 11 : 10, status, headers, content_type,
                               chunked_ ? "Transfer-Encoding: chunked\r\n" : "", keep);
  session_->post_record_status(status);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued_ += head.size();
  }
  session_->send(std::move(head), false, !keep);
}

bool ExchangeImpl::write(std::string data) {
  if (data.empty()) return !cancelled_;
  std::string framed;
  if (chunked_) {
    char size[24];
    std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    framed = size + data + "\r\n";
  } else {
    framed = std::move(data);
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return cancelled_ || queued_ < kStreamHighWater; });
    if (cancelled_) return false;
    queued_ += framed.size();
  }
  session_->send(std::move(framed), false, false);
  return true;
}

void ExchangeImpl::end_stream() {
  session_->send(chunked_ ? std::string("0\r\n\r\n") : std::string(), true, !chunked_);
}

}  // namespace

void HttpTransport::Impl::refuse(tcp::socket& socket) {
  // One non-blocking write of a fixed answer; nothing of the request is read.
  static const std::string kBody =
      "{\"error\":{\"message\":\"Too many open connections; retry later.\",\"type\":\"server_error\","
      "\"param\":null,\"code\":\"too_many_connections\"}}";
  static const std::string kAnswer = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                     "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
                                     std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
  error_code ec;
  socket.non_blocking(true, ec);
  socket.write_some(net::buffer(kAnswer), ec);
  socket.shutdown(tcp::socket::shutdown_both, ec);
  socket.close(ec);
  if (observer) observer("", 503);
}

void HttpTransport::Impl::accept() {
  acceptor.async_accept(net::make_strand(io), [self = shared_from_this()](error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !self->acceptor.is_open()) return;
    if (!ec) {
      if (self->stopping || self->open.load() >= self->limits.max_connections) {
        self->refuse(socket);
      } else {
        error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);  // stream events are small writes
        socket.set_option(net::socket_base::send_buffer_size(kSendBufferBytes), ignored);
        std::make_shared<Session>(self, std::move(socket))->start();
      }
    } else if (ec == net::error::no_descriptors) {
      // Out of file descriptors: wait a moment instead of spinning.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    self->accept();
  });
}

HttpTransport::HttpTransport(TransportLimits limits, HttpHandler handler, HttpObserver observer,
                             HttpErrorBody error_body)
    : impl_(std::make_shared<Impl>(std::move(limits), std::move(handler), std::move(observer),
                                   std::move(error_body))) {}

HttpTransport::~HttpTransport() = default;

int HttpTransport::listen(const std::string& host, int port) {
  Impl& t = *impl_;
  error_code ec;
  tcp::resolver resolver(t.io);
  const auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (ec || endpoints.empty()) throw Error("cannot resolve --host " + host + ": " + ec.message());
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  t.acceptor.open(endpoint.protocol(), ec);
  if (!ec) t.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) t.acceptor.bind(endpoint, ec);
  if (!ec) t.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    throw Error("cannot listen on " + host + ":" + std::to_string(port) + " (" + ec.message() + ")");
  t.accept();
  return t.acceptor.local_endpoint().port();
}

void HttpTransport::run() {
  Impl& t = *impl_;
  auto guard = net::make_work_guard(t.io);
  std::vector<std::thread> threads;
  for (int i = 1; i < std::max(1, t.limits.io_threads); ++i) threads.emplace_back([&t] { t.io.run(); });
  t.io.run();
  for (auto& th : threads) th.join();
}

void HttpTransport::stop(std::chrono::milliseconds grace) {
  Impl& t = *impl_;
  t.stopping = true;
  net::post(t.acceptor.get_executor(), [impl = impl_] {
    error_code ignored;
    impl->acceptor.close(ignored);
  });
  const auto until = std::chrono::steady_clock::now() + grace;
  while (t.responding.load() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  t.io.stop();
}

int HttpTransport::open_connections() const {
  return impl_->open.load();
}

}  // namespace microspec::server
