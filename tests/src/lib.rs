//! Shared helpers of the scenario suite.
