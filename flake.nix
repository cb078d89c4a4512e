{
  description = "berth: a single-binary deployment control plane for self-hosters";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      packages = forAll (pkgs: rec {
        berth = pkgs.callPackage ./nix/package.nix { };
        default = berth;
      });

      # services.berth.enable = true; the package defaults to this flake's.
      nixosModules.berth = { pkgs, lib, ... }: {
        imports = [ ./nix/module.nix ];
        services.berth.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.berth;
      };
      nixosModules.default = self.nixosModules.berth;

      devShells = forAll (pkgs: {
        default = pkgs.mkShell {
          packages = with pkgs; [ cargo rustc clippy rustfmt pkg-config nix postgresql sqlite nodejs chromium wrk ];
        };
      });
    };
}
