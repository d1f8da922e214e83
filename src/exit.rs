//! Process exit statuses (sysexits) and the one-line failure that goes with them.

use std::fmt;

/// A command's failure: the exit status and one line that names what was wrong and where.
#[derive(Debug)]
pub(crate) struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    /// 1: a runtime failure.
    pub(crate) fn runtime(message: impl fmt::Display) -> Failure {
        Failure::with_code(1, message)
    }

    /// 2: the command line was not usable.
    pub(crate) fn usage(message: impl fmt::Display) -> Failure {
        Failure::with_code(2, message)
    }

    /// 69: a needed service is unavailable.
    pub(crate) fn unavailable(message: impl fmt::Display) -> Failure {
        Failure::with_code(69, message)
    }

    /// 73: the state directory cannot be created or locked.
    pub(crate) fn state(message: impl fmt::Display) -> Failure {
        Failure::with_code(73, message)
    }

    /// 75: a temporary failure; trying again later may succeed.
    pub(crate) fn temporary(message: impl fmt::Display) -> Failure {
        Failure::with_code(75, message)
    }

    /// 78: configuration error.
    pub(crate) fn config(message: impl fmt::Display) -> Failure {
        Failure::with_code(78, message)
    }

    /// Whether this is a configuration error (78).
    pub(crate) fn is_config(&self) -> bool {
        self.code == 78
    }

    fn with_code(code: u8, message: impl fmt::Display) -> Failure {
        Failure {
            code,
            message: message.to_string().replace('\n', " "),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A store failure's status: 78 when the store cannot work as configured, 69 when the database
/// server cannot be reached (it may come back), 73 when the state itself cannot be used.
impl From<crate::store::StoreError> for Failure {
    fn from(err: crate::store::StoreError) -> Failure {
        match err.kind() {
            crate::store::ErrorKind::Config => Failure::config(err),
            crate::store::ErrorKind::ServerDown => Failure::unavailable(err),
            crate::store::ErrorKind::WriteRefused | crate::store::ErrorKind::Broken => {
                Failure::state(err)
            }
        }
    }
}
