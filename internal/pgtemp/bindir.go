package pgtemp

// BinDirEnv names the environment variable that, when set, is the
// directory of the installation that servers start from (its initdb and
// postgres), instead of the one found on PATH or in the usual install
// directories: to run tests on another major version of PostgreSQL.
const BinDirEnv = "IDEM_PG_BIN"
