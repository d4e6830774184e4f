// Files dynamiq writes (the metrics file, the debug log) often sit in a shared directory such as
// /tmp, where another user may have placed a symbolic link (or a FIFO) at the name beforehand to
// make the job write through it. Every such write goes through these functions, which never
// follow a symbolic link at the file's name and create temporaries with O_EXCL:
// - open_output_nofollow: the file itself, opened O_NOFOLLOW (a link at its name fails with
//   ELOOP), without blocking on a FIFO, and refused unless it is a regular file;
// - write_file_replacing: the whole content into a temporary created O_CREAT | O_EXCL |
//   O_NOFOLLOW under an unpredictable name beside the file, then renamed over it (rename(2)
//   replaces a link at the name, never its target).
// A failure returns false / -1 with the reason in *why; the caller warns once and stops writing
// that file (the job itself continues).
#pragma once

#include <string>
#include <string_view>

namespace dq {

// A descriptor for writing `path` (O_WRONLY | O_CLOEXEC | O_NOFOLLOW, created 0644 if missing,
// truncated when `truncate`, O_APPEND when `append`), or -1 with *why set.
int open_output_nofollow(const std::string& path, bool truncate, bool append, std::string* why);

// A new file beside `path` named `path`.tmp.<pid>.<random hex>, created O_CREAT | O_EXCL |
// O_NOFOLLOW (0644); its name in *tmp_path. -1 with *why set when no fresh name could be created
// (a bounded number of tries).
int create_temporary_beside(const std::string& path, std::string* tmp_path, std::string* why);

// `data` written to a temporary beside `path`, then renamed over `path`. False with *why set (the
// temporary removed) on any failure.
bool write_file_replacing(const std::string& path, std::string_view data, std::string* why);

}  // namespace dq
