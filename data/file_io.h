// POSIX file plumbing shared by the readers and writers of data/ (internal to keel_data):
// a read-only whole-file mapping and a writer whose errors name the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace keel::data::detail {

// strerror(err) as a std::string ("No space left on device").
std::string errno_text(int err);

// 'path': how messages of data/ show a file name (or a token, a field).
inline std::string quoted(const std::string& s) { return "'" + s + "'"; }

// The whole file (a small text: a tokenizer, a template, a text corpus file); throws DataError
// naming the path and the reason.
std::string read_file(const std::string& path, const std::string& kind);

// A read-only mapping of a whole regular file. Missing, unreadable, non-regular and empty
// files throw DataError naming the path; `kind` says what the file should be ("token file").
// A file that shrinks while it is mapped (truncated, rewritten in place) makes a read past its
// new end raise SIGBUS: the process then prints "keel: data error:" naming the file, and exits 3.
class MappedFile {
 public:
  static MappedFile open(const std::string& path, const std::string& kind);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  const unsigned char* data() const { return static_cast<const unsigned char*>(base_); }
  int64_t size() const { return size_; }

 private:
  void reset() noexcept;
  std::string path_;
  void* base_ = nullptr;
  int64_t size_ = 0;
};

// Creates/truncates `path` and writes to it; every failure (EACCES at open, ENOSPC at write or
// close, ...) throws DataError naming the path. The destructor closes quietly: call close() to
// learn about errors that only show up then (NFS, quotas).
class FileWriter {
 public:
  explicit FileWriter(const std::string& path);
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  ~FileWriter();

  void write(const void* data, size_t bytes);
  // fsync(2): the bytes written so far are on disk (a crash after this cannot lose them).
  void sync();
  void close();
  int64_t bytes_written() const { return written_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t written_ = 0;
};

// A small text file (JSON, a pointer) written whole through FileWriter: a full disk or a file-size
// limit throws DataError naming the path and the reason (an ofstream would only fail at its
// destructor, silently, for a file smaller than its buffer). No fsync.
void write_text_file(const std::string& path, const std::string& text);

// fsync a directory, so a rename or a new entry in it survives a crash.
void sync_directory(const std::string& path);

bool file_exists(const std::string& path);  // any kind of file, following links

// This machine's host name, "unknown-host" when it cannot be read (it is part of file names).
std::string this_host();

}  // namespace keel::data::detail
