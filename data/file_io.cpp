#include "data/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <fstream>
#include <sstream>

#include "data/token_file.h"

namespace keel::data::detail {

std::string errno_text(int err) { return std::strerror(err); }

namespace {

// A read of a mapping whose file shrank after it was mapped (truncated, or rewritten in place by a
// tool that opens it with O_TRUNC, as llm.c's and many preprocessing scripts do) raises SIGBUS:
// without a handler the process dies with "Bus error" and no word of which file. Each mapping is
// registered here with the message to give, so the handler can name it and exit as a data error.
// The handler reads the table, so it is lock-free: chunks of slots in a list that only grows
// (a data set of 10k shards is ordinary). A chunk is allocated outside the handler and published
// with one atomic store; the handler only follows the pointers. Should an allocation fail, that
// mapping is not named: a fault in it goes on to the previous handler.
//
// The handler goes in front of whatever handled SIGBUS before (Open MPI's MPI_Init installs a
// stack-trace handler, the sanitizers theirs) and hands it every SIGBUS that is not a read of a
// registered mapping. A slot is only reused after its mapping is unregistered, which is before
// it is unmapped, so a fault the handler matches is in a live mapping unless the program reads
// a MappedFile while another thread destroys it.
struct MappingSlot {
  std::atomic<bool> claimed{false};
  std::atomic<const unsigned char*> base{nullptr};  // published last: the slot is complete
  int64_t size = 0;
  char message[512];
};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<const unsigned char*>::is_always_lock_free,
              "the SIGBUS handler may only read lock-free atomics");
constexpr size_t kSlotsPerChunk = 1024;
struct SlotChunk {
  MappingSlot slots[kSlotsPerChunk];
  std::atomic<SlotChunk*> next{nullptr};
};
SlotChunk g_mappings;  // the first chunk; the others are never freed (the handler may be reading them)
constexpr int kExitDataError = 3;  // keel's exit code for bad data (train/run.h)

std::mutex g_install_mu;
struct sigaction g_previous_action {};  // SIGBUS's handler before ours, written under g_install_mu

extern "C" void on_mapping_fault(int, siginfo_t* info, void*) {
  // Only a fault of the kernel's (si_code > 0) has an address: a SIGBUS sent with kill has none.
  const auto* addr = info->si_code > 0 ? static_cast<const unsigned char*>(info->si_addr) : nullptr;
  for (SlotChunk* chunk = &g_mappings; chunk != nullptr; chunk = chunk->next.load(std::memory_order_acquire))
    for (MappingSlot& slot : chunk->slots) {
      const unsigned char* base = slot.base.load(std::memory_order_acquire);
      if (addr != nullptr && base != nullptr && addr >= base && addr < base + slot.size) {
        const ssize_t ignored = ::write(STDERR_FILENO, slot.message, std::strlen(slot.message));
        (void)ignored;
        _exit(kExitDataError);
      }
    }
  // Not one of ours: put the previous handler back. Returning from a fault re-runs the access,
  // which then reaches it; a sent signal does not recur, so it is raised again.
  sigaction(SIGBUS, &g_previous_action, nullptr);
  if (info->si_code <= 0) raise(SIGBUS);
}

// Checked at every registration, not once: a handler installed after ours (MPI_Init after the
// first file was mapped) would otherwise leave the files it maps unnamed.
void install_fault_handler() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  struct sigaction current {};
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_mapping_fault) return;
  g_previous_action = current;
  struct sigaction sa {};
  sa.sa_sigaction = on_mapping_fault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, nullptr);
}

// A free slot, claimed for the caller; a new chunk when every one is taken; nullptr when none
// can be allocated.
MappingSlot* claim_slot() {
  for (SlotChunk* chunk = &g_mappings;;) {
    for (MappingSlot& slot : chunk->slots) {
      bool expected = false;
      if (slot.claimed.compare_exchange_strong(expected, true)) return &slot;
    }
    SlotChunk* next = chunk->next.load(std::memory_order_acquire);
    if (next == nullptr) {
      auto* fresh = new (std::nothrow) SlotChunk;
      if (fresh == nullptr) return nullptr;
      // Another thread may have appended one meanwhile: then use that one.
      if (chunk->next.compare_exchange_strong(next, fresh, std::memory_order_acq_rel)) next = fresh;
      else delete fresh;
    }
    chunk = next;
  }
}

void register_mapping(const void* base, int64_t size, const std::string& kind, const std::string& path) {
  install_fault_handler();
  MappingSlot* slot = claim_slot();
  if (slot == nullptr) return;
  slot->size = size;
  std::snprintf(slot->message, sizeof slot->message,
                "keel: data error: %s '%s' is shorter than the %lld bytes it had when keel opened it: it was "
                "truncated or rewritten in place while keel read it. Restore it (or write new data to new files) "
                "and run again (keel train resumes from its last checkpoint)\n",
                kind.c_str(), path.c_str(), static_cast<long long>(size));
  slot->message[sizeof slot->message - 2] = '\n';  // a path too long for the message still ends a line
  slot->base.store(static_cast<const unsigned char*>(base), std::memory_order_release);
}

void unregister_mapping(const void* base) {
  for (SlotChunk* chunk = &g_mappings; chunk != nullptr; chunk = chunk->next.load(std::memory_order_acquire))
    for (MappingSlot& slot : chunk->slots)
      if (slot.base.load(std::memory_order_acquire) == base) {
        slot.base.store(nullptr, std::memory_order_release);
        slot.claimed.store(false, std::memory_order_release);
        return;
      }
}

}  // namespace

std::string read_file(const std::string& path, const std::string& kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) throw DataError(kind + " '" + path + "' does not exist");
    throw DataError("cannot read " + kind + " '" + path + "': " + errno_text(err));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw DataError("cannot read " + kind + " '" + path + "': " + errno_text(errno));
  return ss.str();
}

MappedFile MappedFile::open(const std::string& path, const std::string& kind) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) throw DataError(kind + " '" + path + "' does not exist");
    throw DataError("cannot open " + kind + " '" + path + "': " + errno_text(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw DataError("cannot stat " + kind + " '" + path + "': " + errno_text(err));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw DataError(kind + " '" + path + "' is a directory, not a file");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(kind + " '" + path + "' is not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    throw DataError(kind + " '" + path + "' is empty (0 bytes)");
  }
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (base == MAP_FAILED) {
    throw DataError("cannot memory-map " + kind + " '" + path + "' (" + std::to_string(st.st_size) +
                    " bytes): " + errno_text(err));
  }
  register_mapping(base, st.st_size, kind, path);
  MappedFile file;
  file.path_ = path;
  file.base_ = base;
  file.size_ = st.st_size;
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), base_(other.base_), size_(other.size_) {
  other.base_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    base_ = other.base_;
    size_ = other.size_;
    other.base_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::reset() noexcept {
  if (base_ != nullptr) {
    unregister_mapping(base_);
    munmap(base_, static_cast<size_t>(size_));
  }
  base_ = nullptr;
  size_ = 0;
}

FileWriter::FileWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw DataError("cannot create '" + path + "': " + errno_text(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t bytes) {
  if (fd_ < 0) throw DataError("write to '" + path_ + "' after it was closed");
  const char* p = static_cast<const char*>(data);
  // write(2) moves at most ~2 GiB per call and may move less; loop until done.
  constexpr size_t max_chunk = size_t{1} << 30;
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, std::min(bytes, max_chunk));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw DataError("cannot write '" + path_ + "': " + errno_text(errno));
    }
    if (n == 0) throw DataError("cannot write '" + path_ + "': write made no progress");
    p += n;
    bytes -= static_cast<size_t>(n);
    written_ += n;
  }
}

void FileWriter::sync() {
  if (fd_ < 0) throw DataError("fsync of '" + path_ + "' after it was closed");
  if (::fsync(fd_) != 0) throw DataError("cannot flush '" + path_ + "' to disk: " + errno_text(errno));
}

void write_text_file(const std::string& path, const std::string& text) {
  FileWriter w(path);
  w.write(text.data(), text.size());
  w.close();
}

void sync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw DataError("cannot open directory '" + path + "' to flush it: " + errno_text(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw DataError("cannot flush directory '" + path + "' to disk: " + errno_text(err));
}

void FileWriter::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw DataError("cannot finish writing '" + path_ + "': " + errno_text(errno));
}

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "unknown-host";
  return name;
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace keel::data::detail
