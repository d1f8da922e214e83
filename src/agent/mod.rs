//! The agent side of a turn: chat messages, model backends, and the tools a model may call.

pub(crate) mod catalog;
mod confinement;
pub(crate) mod endpoint;
pub(crate) mod mcp;
mod mcp_bounds;
mod mcp_http;
mod mcp_stdio;
pub(crate) mod message;
pub(crate) mod model;
mod pace;
pub(crate) mod process;
pub(crate) mod sandbox;
pub(crate) mod textcall;
pub(crate) mod tools;
pub(crate) mod unit;
