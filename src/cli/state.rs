//! Operator access to the configured store for the inspection commands.

use std::path::PathBuf;

use crate::config::{self, ConfigSource};
use crate::exit::Failure;
use crate::ingress::api::UsageLimits;
use crate::store::{Store, StoreError};
use crate::usage::Price;

/// Operator access to the configured store, opened as it is: a missing SQLite database is
/// "nothing stored yet", never created by a command that only looks.
pub(super) struct StateAccess {
    pub(super) state_dir: PathBuf,
    pub(super) store: Option<Store>,
    pub(super) runtime: tokio::runtime::Runtime,
    /// `[model] price`: the cost of usage shown.
    pub(super) price: Option<Price>,
    /// What `usage` shows figures against.
    pub(super) limits: UsageLimits,
}

impl StateAccess {
    pub(super) fn open(source: &ConfigSource) -> Result<StateAccess, Failure> {
        let location = config::state_location(source).map_err(Failure::config)?;
        let runtime = super::runtime()?;
        let store = runtime
            .block_on(Store::attach(&location.store, &location.state_dir))
            .map_err(Failure::from)?;
        Ok(StateAccess {
            state_dir: location.state_dir,
            store,
            runtime,
            price: location.price,
            limits: UsageLimits {
                price: location.price,
                budgets: location.budgets,
                routes: location.route_budgets,
            },
        })
    }

    /// Gives files a root-run command created back to the state directory's owner.
    pub(super) fn restore_ownership(&self) -> Result<(), Failure> {
        crate::store::StateDir::new(&self.state_dir)
            .restore_ownership()
            .map_err(|err| {
                Failure::state(format!(
                    "{}: cannot restore ownership: {err}",
                    self.state_dir.display()
                ))
            })
    }

    /// Runs `query` on the store; `None` when nothing is stored yet.
    pub(super) fn query<T>(
        &self,
        query: impl AsyncFnOnce(&Store) -> Result<T, StoreError>,
    ) -> Result<Option<T>, Failure> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        self.runtime
            .block_on(query(store))
            .map(Some)
            .map_err(Failure::from)
    }
}
