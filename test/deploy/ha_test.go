package deploy

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
)

// secretCert parses the PEM certificate under key of the chart's Secret.
func secretCert(t *testing.T, objs map[string]map[string]any, name, key string) *x509.Certificate {
	t.Helper()
	s := objs["Secret/modeguard/"+name]
	if s == nil {
		t.Fatalf("no Secret %s", name)
	}
	raw, err := base64.StdEncoding.DecodeString(get(t, s, "data", key).(string))
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(raw)
	if block == nil {
		t.Fatalf("%s/%s is no PEM", name, key)
	}
	c, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// flagValues answers every value of --name in args.
func flagValues(args []any, name string) []string {
	var found []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a.(string), name+"="); ok {
			found = append(found, v)
		} else if a == name {
			found = append(found, "")
		}
	}
	return found
}

// envFrom answers the fieldPath an env variable of c is taken from.
func envFrom(t *testing.T, c map[string]any, name string) string {
	t.Helper()
	env, _ := c["env"].([]any)
	for _, e := range env {
		e := e.(map[string]any)
		if e["name"] == name {
			if p, ok := get(t, e, "valueFrom", "fieldRef", "fieldPath").(string); ok {
				return p
			}
		}
	}
	return ""
}

// TestChartRunsTwoControllersAndTheNFSTarget: the chart's defaults run two
// controller replicas that keep nothing on their nodes, with the sidecars
// elected on Leases, the driver's peer port wired end to end (the address a
// replica records is its pod's, the Service lists every replica ready or
// not, the certificate serves the name peers check), a budget that lets a
// drain take one at a time, replicas kept apart, and the NFS target reached
// by the name its certificate carries at the port it listens on.
func TestChartRunsTwoControllersAndTheNFSTarget(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  []string
	}{
		{"loop pools", nil},
		{"storage targets", []string{"--set", "iscsi.enabled=true", "--set", "csiAddons.enabled=true"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := helmTemplate(t, tc.set...)
			d := objs["Deployment/modeguard/modeguard-controller"]
			if n := get(t, d, "spec", "replicas"); fmt.Sprint(n) != "2" {
				t.Fatalf("the controller runs %v replicas by default, want 2", n)
			}
			if s := get(t, d, "spec", "strategy").(map[string]any); s["type"] != "RollingUpdate" ||
				fmt.Sprint(get(t, s, "rollingUpdate", "maxSurge")) != "0" || fmt.Sprint(get(t, s, "rollingUpdate", "maxUnavailable")) != "1" {
				t.Errorf("the replicas are replaced by %v, want one at a time and never a third", s)
			}
			spec := get(t, d, "spec", "template", "spec").(map[string]any)
			containers := containersOf(spec)
			driver := containers["modeguard"]
			args := driver["args"].([]any)

			// Nothing on the controller's node: no NFS, no fence file; with
			// storage targets not even the pools or /dev.
			for _, f := range []string{"--nfs-export-root", "--nfs-ganesha-dir", "--fence-file"} {
				if v := flagValues(args, f); len(v) > 0 {
					t.Errorf("the controller keeps state on its node: %s=%v", f, v)
				}
			}
			var hostDirs []string
			for _, v := range spec["volumes"].([]any) {
				if hp, ok := v.(map[string]any)["hostPath"].(map[string]any); ok {
					hostDirs = append(hostDirs, hp["path"].(string))
				}
			}
			if tc.set != nil && len(hostDirs) > 0 {
				t.Errorf("with storage targets the controller still mounts host directories %v", hostDirs)
			}
			if tc.set == nil && !slices.Equal(hostDirs, []string{"/var/lib/modeguard/pools", "/dev"}) {
				t.Errorf("over loop pools the controller mounts %v, want the pools and /dev only", hostDirs)
			}
			if tc.set != nil && driver["securityContext"] != nil {
				t.Errorf("with storage targets the controller is still privileged: %v", driver["securityContext"])
			}

			// The NFS target, by the name its certificate carries and the
			// port it serves.
			nfsTarget := flagValues(args, "--nfs-target")
			if len(nfsTarget) != 1 {
				t.Fatalf("the controller has --nfs-target %v", nfsTarget)
			}
			host, port, err := net.SplitHostPort(nfsTarget[0])
			if err != nil {
				t.Fatal(err)
			}
			svc := objs["Service/modeguard/modeguard-nfs"]
			if host != "modeguard-nfs.modeguard.svc" || svc == nil || fmt.Sprint(get(t, svc, "spec", "ports", 0, "port")) != port {
				t.Errorf("the controller dials %s, not the NFS target's Service", nfsTarget[0])
			}
			target := containersOf(get(t, objs["StatefulSet/modeguard/modeguard-nfs"], "spec", "template", "spec").(map[string]any))["modeguard"]
			if ep := flagValues(target["args"].([]any), "--target-endpoint"); len(ep) != 1 || !strings.HasSuffix(ep[0], ":"+port) {
				t.Errorf("the NFS target serves %v, the controller dials port %s", ep, port)
			}
			ca := secretCert(t, objs, "modeguard-iscsi-ca", "tls.crt")
			roots := x509.NewCertPool()
			roots.AddCert(ca)
			if _, err := secretCert(t, objs, "modeguard-nfs-tls", "tls.crt").Verify(x509.VerifyOptions{Roots: roots, DNSName: host,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				t.Errorf("the NFS target's certificate does not serve %s: %v", host, err)
			}

			// The peer port: the pod's own address, listed by a headless
			// Service of every replica, and a certificate both ends accept.
			listen := flagValues(args, "--controller-peer-listen")
			if len(listen) != 1 || !strings.HasPrefix(listen[0], "tcp://$(POD_IP):") || envFrom(t, driver, "POD_IP") != "status.podIP" {
				t.Errorf("the peer listener %v is not on the pod's address (POD_IP from %q)", listen, envFrom(t, driver, "POD_IP"))
			}
			peerPort := strings.TrimPrefix(listen[0], "tcp://$(POD_IP):")
			peers := objs["Service/modeguard/modeguard-controller-peers"]
			if peers == nil {
				t.Fatal("no Service modeguard-controller-peers")
			}
			ps := get(t, peers, "spec").(map[string]any)
			if ps["clusterIP"] != "None" || ps["publishNotReadyAddresses"] != true || fmt.Sprint(get(t, ps, "ports", 0, "port")) != peerPort {
				t.Errorf("the peers' Service is not headless, hides replicas that are not ready, or has another port: %v", ps)
			}
			if got := flagValues(args, "--controller-peers"); !slices.Equal(got, []string{"modeguard-controller-peers.modeguard.svc:" + peerPort}) {
				t.Errorf("--controller-peers %v does not name the peers' Service", got)
			}
			var portNamed bool
			for _, p := range driver["ports"].([]any) {
				p := p.(map[string]any)
				portNamed = portNamed || (p["name"] == get(t, ps, "ports", 0, "targetPort") && fmt.Sprint(p["containerPort"]) == peerPort)
			}
			if !portNamed {
				t.Errorf("the peers' Service targets a port the driver's container does not name: %v", driver["ports"])
			}
			controllerCert := secretCert(t, objs, "modeguard-controller-tls", "tls.crt")
			for _, use := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
				if _, err := controllerCert.Verify(x509.VerifyOptions{Roots: roots, DNSName: "modeguard-controller-peer",
					KeyUsages: []x509.ExtKeyUsage{use}}); err != nil {
					t.Errorf("the controller's certificate does not serve modeguard-controller-peer for use %v: %v", use, err)
				}
			}
			if flagValues(args, "--tls-cert") == nil {
				t.Error("the controller has no certificate for its peer port")
			}

			// The sidecars' election.
			for _, name := range []string{"csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter"} {
				c := containers[name]
				if c == nil {
					t.Errorf("no %s", name)
					continue
				}
				a := c["args"].([]any)
				if !slices.Equal(flagValues(a, "--leader-election"), []string{""}) ||
					!slices.Equal(flagValues(a, "--leader-election-namespace"), []string{"$(NAMESPACE)"}) ||
					envFrom(t, c, "NAMESPACE") != "metadata.namespace" {
					t.Errorf("%s is not elected on a Lease in the release's namespace: %v", name, a)
				}
				for _, f := range []string{"--leader-election-lease-duration=10s", "--leader-election-renew-deadline=8s", "--leader-election-retry-period=2s"} {
					if !slices.Contains(a, any(f)) {
						t.Errorf("%s lacks %s", name, f)
					}
				}
				if g := flagValues(a, "--feature-gates"); len(g) != 1 || !strings.Contains(g[0], "ReleaseLeaderElectionOnExit=true") {
					t.Errorf("%s does not hand its Lease over when it stops: --feature-gates %v", name, g)
				}
			}

			// A drain takes one replica at a time, and the replicas are kept
			// apart.
			pdb := objs["PodDisruptionBudget/modeguard/modeguard-controller"]
			if pdb == nil || fmt.Sprint(get(t, pdb, "spec", "maxUnavailable")) != "1" ||
				fmt.Sprint(get(t, pdb, "spec", "selector", "matchLabels")) != fmt.Sprint(get(t, d, "spec", "selector", "matchLabels")) {
				t.Errorf("no budget of one replica for the controller's pods: %v", pdb)
			}
			anti := get(t, spec, "affinity", "podAntiAffinity").(map[string]any)
			if len(anti["preferredDuringSchedulingIgnoredDuringExecution"].([]any)) != 2 || anti["requiredDuringSchedulingIgnoredDuringExecution"] != nil {
				t.Errorf("the replicas are not kept apart by node and zone where they can be: %v", anti)
			}
		})
	}

	t.Run("host network", func(t *testing.T) {
		spec := get(t, helmTemplate(t, "--set", "controller.hostNetwork=true")["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec").(map[string]any)
		required, _ := get(t, spec, "affinity", "podAntiAffinity", "requiredDuringSchedulingIgnoredDuringExecution").([]any)
		if len(required) != 1 || get(t, required[0], "topologyKey") != "kubernetes.io/hostname" {
			t.Errorf("two replicas on the host's network may share a node and its ports: %v", spec["affinity"])
		}
	})
	t.Run("one replica", func(t *testing.T) {
		objs := helmTemplate(t, "--set", "controller.replicas=1")
		spec := get(t, objs["Deployment/modeguard/modeguard-controller"], "spec", "template", "spec").(map[string]any)
		for name, c := range containersOf(spec) {
			if name == "modeguard" {
				if v := flagValues(c["args"].([]any), "--controller-peer-listen"); v != nil {
					t.Errorf("one replica listens for peers: %v", v)
				}
				continue
			}
			if a, ok := c["args"].([]any); ok && strings.HasPrefix(name, "csi-") && name != "csi-snapshot-metadata" && name != "csi-addons" &&
				!slices.Equal(flagValues(a, "--leader-election"), []string{"false"}) {
				t.Errorf("%s of the only replica runs an election: %v", name, a)
			}
		}
		for _, key := range []string{"Service/modeguard/modeguard-controller-peers", "PodDisruptionBudget/modeguard/modeguard-controller"} {
			if objs[key] != nil {
				t.Errorf("one replica has %s", key)
			}
		}
		if spec["affinity"] != nil {
			t.Errorf("one replica is kept apart from nothing: %v", spec["affinity"])
		}
	})
}
