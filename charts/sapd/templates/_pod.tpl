{{/* The pod every job runs: its settings (jobDefaults merged with the job block), metadata, image, the
     common part of its spec, volumes and mounts, the common part of its container. */}}

{{/* One job's pod settings: jobDefaults merged with the job block (lists concatenated, maps merged,
     the job's non-empty scalars winning). Returned as YAML, for `fromYaml`. */}}
{{- define "sapd.settings" -}}
{{- $d := .root.Values.jobDefaults -}}
{{- $j := .job | default dict -}}
{{- $out := dict -}}
{{- range $k := list "extraEnv" "envFrom" "extraVolumes" "extraVolumeMounts" "tolerations" "topologySpreadConstraints" -}}
{{- $_ := set $out $k (concat (get $d $k | default list) (get $j $k | default list)) -}}
{{- end -}}
{{- range $k := list "podAnnotations" "podLabels" "jobAnnotations" "nodeSelector" "affinity" -}}
{{- $_ := set $out $k (mergeOverwrite (deepCopy (get $d $k | default dict)) (deepCopy (get $j $k | default dict))) -}}
{{- end -}}
{{- range $k := list "priorityClassName" "serviceAccountName" "runtimeClassName" "schedulerName" "terminationGracePeriodSeconds" -}}
{{- $v := get $j $k -}}
{{- if or (kindIs "invalid" $v) (eq (toString $v) "") -}}{{- $v = get $d $k -}}{{- end -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Pod template metadata: selector labels, part-of/version, the round, the job's podLabels and
     podAnnotations (merged over jobDefaults'). */}}
{{- define "sapd.podMeta" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
labels:
  {{- include "sapd.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/part-of: sapd
  app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
  {{- if .round }}
  sapd.io/round: {{ .round | quote }}
  {{- end }}
  {{- with $s.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $s.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The image of a job: its block's `image` keys over the top-level ones; the tag defaults to
     <appVersion>-<flavor>; a digest wins over the tag: the job block's own `image.digest`, else the
     top-level `image.digests[<flavor>]` (each flavor is its own image). `.flavor` (optional) is the
     job's default flavor. */}}
{{- define "sapd.imageRef" -}}
{{- $img := mergeOverwrite (deepCopy .root.Values.image) (deepCopy (.job.image | default dict)) -}}
{{- $flavor := $img.flavor -}}
{{- if and .flavor (not (.job.image | default dict).flavor) -}}{{- $flavor = .flavor -}}{{- end -}}
{{- $digest := (.job.image | default dict).digest | default (get (.root.Values.image.digests | default dict) $flavor) -}}
{{- if $digest -}}
{{- printf "%s@%s" $img.repository $digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository ($img.tag | default (printf "%s-%s" .root.Chart.AppVersion $flavor)) -}}
{{- end -}}
{{- end -}}

{{- define "sapd.image" -}}
{{- $img := omit (mergeOverwrite (deepCopy .root.Values.image) (deepCopy (.job.image | default dict))) "digests" -}}
image: {{ include "sapd.imageRef" . | quote }}
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{/* Pod-spec fields shared by every job: identity, scheduling, security, volumes. Context keys: root,
     component, job; `shm` (size), `scratch` (size), `extraVolumes` (chart-internal volumes),
     `serviceAccount` (the driver's own), `automount` (mount the token), `noConfig` (no run config
     volume: the uninstall hook, which runs after the ConfigMap is gone). */}}
{{- define "sapd.podCommon" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
restartPolicy: Never
{{- with (.serviceAccount | default $s.serviceAccountName) }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ .automount | default false }}
{{- with $s.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $s.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $s.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" $s.terminationGracePeriodSeconds) }}
terminationGracePeriodSeconds: {{ int $s.terminationGracePeriodSeconds }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.securityContext.pod | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- if not .noConfig }}
  - name: config
    configMap:
      name: {{ include "sapd.name" (dict "root" .root "component" "config") }}
      items:
        - key: {{ .configKey | default .component }}.yaml
          path: config.yaml
  {{- end }}
  - name: scratch
    emptyDir:
      sizeLimit: {{ .scratch | default .job.scratchSize | default .root.Values.scratchSize }}
  - name: tmp
    emptyDir:
      sizeLimit: 10Gi
  {{- with .shm | default .job.shmSize }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ . }}
  {{- end }}
  {{- with .root.Values.modelCache }}
  {{- if eq .type "hostPath" }}
  # an existing folder (the kubelet would create a missing one root-owned 0755, which uid 1000 cannot write)
  - name: model-cache
    hostPath:
      path: {{ .hostPath }}
      type: Directory
  {{- else if eq .type "pvc" }}
  - name: model-cache
    persistentVolumeClaim:
      claimName: {{ required "modelCache.claimName is required with modelCache.type pvc" .claimName }}
  {{- end }}
  {{- end }}
  {{- with .extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $s.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The volume mounts every container of a job gets. */}}
{{- define "sapd.mounts" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
{{ if not .noConfig -}}
- name: config
  mountPath: /etc/sapd
  readOnly: true
{{ end -}}
- name: scratch
  mountPath: /scratch
- name: tmp
  mountPath: /tmp
{{- if .shm | default .job.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .root.Values.modelCache.type }}
- name: model-cache
  mountPath: {{ .root.Values.modelCache.mountPath }}
{{- end }}
{{- with .extraMounts }}
{{ toYaml . }}
{{- end }}
{{- with $s.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Container fields shared by every job's main container. */}}
{{- define "sapd.containerCommon" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
{{ include "sapd.image" . }}
securityContext:
  {{- toYaml .root.Values.securityContext.container | nindent 2 }}
resources:
  {{- toYaml (.resources | default .job.resources) | nindent 2 }}
volumeMounts:
  {{- include "sapd.mounts" . | nindent 2 }}
{{- with $s.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
