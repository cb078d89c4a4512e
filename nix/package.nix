# berth as a Nix package, built from this repository with its Cargo.lock.
{ lib, rustPlatform }:
rustPlatform.buildRustPackage {
  pname = "berth";
  version = "0.1.0";
  src = lib.cleanSourceWith {
    src = ../.;
    # The build needs the crate, its embedded page and docs; not the
    # target dir, test browsers or data dirs.
    filter = path: type:
      let base = baseNameOf path; in
      !(builtins.elem base [ "target" "node_modules" "berth-data" ".git" ]);
  };
  cargoLock.lockFile = ../Cargo.lock;
  # The tests start the real binary on loopback ports and talk to a real
  # PostgreSQL, a real Chromium and a real Nix store: the build sandbox has
  # none of them (and no network). They run in CI (.ci/run) instead.
  doCheck = false;
  meta = {
    description = "A single-binary deployment control plane for self-hosters";
    license = lib.licenses.mit;
    mainProgram = "berth";
    platforms = lib.platforms.linux;
  };
}
