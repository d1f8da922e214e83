//! The one module with unsafe code: what no safe API offers.
//!
//! - Tool and deliver commands die with the daemon (`PR_SET_PDEATHSIG`): after a `kill -9` of
//!   the daemon outside systemd, nothing it started keeps running, so an idempotent re-run after
//!   the restart never races the original.
//! - Descriptors the daemon inherited from its parent without `FD_CLOEXEC` (a supervisor's
//!   sockets, a shell's files) are marked close-on-exec at start, so no tool ever gets them; the
//!   daemon's own descriptors are opened close-on-exec by Rust already.
//! - Descriptors received over a socket (a tool unit's stdin, stdout and stderr) become owned.
//! - Memory the allocator holds free is given back to the kernel (`malloc_trim`): after a flood
//!   of connections, their freed buffers would otherwise stay in the process's arenas.

use std::os::fd::BorrowedFd;

use nix::fcntl::{FcntlArg, FdFlag, fcntl};

/// Makes `command`'s child receive SIGKILL when the thread that started it exits (the daemon's
/// runtime threads live as long as the daemon).
pub(crate) fn die_with_daemon(command: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2),
    // which is async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
}

/// Marks every inherited descriptor above stderr close-on-exec; returns how many needed it. Call
/// at start, before any other thread exists.
pub(crate) fn keep_inherited_descriptors_from_children() -> usize {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    let numbers: Vec<i32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    let mut marked = 0;
    for number in numbers {
        // SAFETY: `number` was listed as open in /proc/self/fd; no other thread exists yet to
        // close it meanwhile, and the borrow ends within this iteration. (The directory's own
        // descriptor, closed by now, fails F_GETFD harmlessly.)
        let fd = unsafe { BorrowedFd::borrow_raw(number) };
        let Ok(flags) = fcntl(fd, FcntlArg::F_GETFD) else {
            continue;
        };
        let flags = FdFlag::from_bits_truncate(flags);
        if !flags.contains(FdFlag::FD_CLOEXEC)
            && fcntl(fd, FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC)).is_ok()
        {
            marked += 1;
        }
    }
    marked
}

/// Takes ownership of a descriptor the kernel installed in this process for a received
/// `SCM_RIGHTS` message (a tool unit's call, `agent/unit.rs`).
pub(crate) fn adopt_received_descriptor(fd: std::os::fd::RawFd) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: `recvmsg` just created `fd` in this process for this message; nothing else
    // knows it, so it has exactly one owner from here on.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
}

/// Gives the memory glibc's allocator holds but does not use back to the kernel, from every
/// arena; whether any was given back.
pub(crate) fn release_free_memory() -> bool {
    // SAFETY: malloc_trim takes no pointer and only walks the allocator's own free lists, under
    // the allocator's locks; any thread may call it at any time.
    unsafe { nix::libc::malloc_trim(0) == 1 }
}
