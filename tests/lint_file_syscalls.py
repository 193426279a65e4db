#!/usr/bin/env python3
"""Nothing above io/ calls a file syscall (docs/design.md, "Every file operation goes through one
Env").

Scans engine/ and tools/ for direct file system calls: POSIX ones (::open, ::pread, ::rename,
::mkdir, ::statvfs, ...), iostreams on files, and std::filesystem operations that touch the disk
(exists, create_directories, remove_all, directory_iterator, ...). Pure path arithmetic
(lexically_normal, parent_path, absolute) is fine. A line may opt out with a comment
"file-syscall-ok: <reason>" (a signal handler, which may only call async-signal-safe functions).
Benchmarks are exempt: their baselines are the raw syscalls (tools/bench_*.cpp).
io::File::open is flagged everywhere, benchmarks included: the engine's files are opened with
io::Env::open_file, so a FaultyEnv can fail the opening too (only io/ itself calls File::open).

usage: lint_file_syscalls.py SOURCE_ROOT   (exit 1 listing each offending line)
"""
import pathlib
import re
import sys

POSIX = ("open openat creat pread pwrite read write close stat lstat fstat fstatat statx ftruncate truncate "
         "fallocate posix_fallocate opendir readdir rename renameat renameat2 unlink unlinkat rmdir mkdir "
         "mkdtemp mkstemp mmap statvfs fstatvfs statfs fstatfs access fsync fdatasync posix_fadvise link symlink")
FS_OPS = ("exists is_directory is_regular_file is_fifo is_symlink status symlink_status directory_iterator "
          "recursive_directory_iterator create_directory create_directories file_size remove remove_all rename "
          "copy copy_file canonical weakly_canonical space last_write_time resize_file")
PATTERNS = [
    # ::open( but not File::open( or x.open(: a global-namespace call.
    re.compile(r"(?<![\w>.])::(?:%s)\s*\(" % "|".join(POSIX.split())),
    re.compile(r"\bstd::(?:i|o)?fstream\b|\bfopen\s*\("),
    re.compile(r"\b(?:std::filesystem|fs)::(?:%s)\b" % "|".join(FS_OPS.split())),
]
# File::open( and io::File::open(, but not SafetensorsFile::open( or MappedFile::open(.
FILE_OPEN = re.compile(r"\bFile::open\s*\(")
EXEMPT_FILES = re.compile(r"^tools/bench_[\w]+\.cpp$")


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    bad = []
    scanned = 0
    for folder in ("engine", "tools"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".cpp", ".h"):
                continue
            rel = path.relative_to(root).as_posix()
            patterns = [FILE_OPEN] if EXEMPT_FILES.match(rel) else PATTERNS + [FILE_OPEN]
            scanned += 1
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("//", 1)[0]
                if "file-syscall-ok:" in line:
                    continue
                if any(p.search(code) for p in patterns):
                    bad.append(f"{rel}:{n}: {line.strip()}")
    if scanned < 50:
        print(f"lint_file_syscalls: only {scanned} files under {root}/engine and tools: wrong root?")
        return 1
    if bad:
        print("file syscalls or File::open above io/ (go through io::Env, see io/env.h):")
        print("\n".join(bad))
        return 1
    print(f"lint_file_syscalls: {scanned} files, no file syscall or File::open above io/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
